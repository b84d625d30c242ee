"""The proxy's bookkeeping and routing decisions, without sockets."""

from __future__ import annotations

import pytest

from kvstream.proxy.app import KVProxy
from kvstream.proxy.core import ByteBudget, ProxyCore, Upstream

UPS = [Upstream("a", "http://a"), Upstream("b", "http://b"), Upstream("c", "http://c")]


def test_failed_engines_are_skipped_with_a_doubling_backoff_until_they_answer() -> None:
    core = ProxyCore(UPS, backoff_s=1.0, max_backoff_s=3.0, max_attempts=2)
    assert core.candidates(["a", "b", "c"], 0.0) == ["a", "b"]
    assert core.failed("a", "refused", 10.0) is True  # up -> down: worth one log line
    assert core.engines["a"].down_until == 11.0
    assert core.candidates(["a", "b", "c"], 10.5) == ["b", "c"]
    assert core.failed("a", "refused", 10.5) is False  # still down: no new log line
    assert core.engines["a"].down_until == 12.5  # doubled
    core.failed("a", "refused", 13.0)
    assert core.engines["a"].down_until == 16.0  # capped at 3 s
    assert core.candidates(["a", "b"], 16.0) == ["a", "b"]
    assert core.answered("a", 32, 32) is True  # back up: one log line
    assert core.answered("a", 32, 32) is False
    assert not core.is_down("a", 0.0) and core.engines["a"].consecutive_failures == 0
    # Everyone down: still try, soonest back first.
    core.failed("b", "x", 20.0)
    core.failed("a", "x", 20.5)
    assert core.candidates(["a", "b"], 20.6) == ["b", "a"]


def test_in_flight_requests_are_the_load_and_accuracy_is_counted() -> None:
    core = ProxyCore(UPS)
    core.started("a")
    core.started("a")
    core.finished("a")
    assert core.loads()["a"].running == 1 and core.loads()["b"].running == 0
    core.answered("a", 64, 64)
    core.answered("a", 64, 48)
    acc = core.view(0.0, {})["routing_accuracy"]
    assert acc == {"requests": 2, "predicted_tokens": 128, "realized_tokens": 112, "exact": 1,
                   "exact_rate": 0.5, "mean_abs_error_tokens": 8.0}
    with pytest.raises(ValueError, match="unique"):
        ProxyCore([UPS[0], UPS[0]])


def test_speculation_sends_a_burst_of_the_same_prefix_to_the_first_choice() -> None:
    proxy = KVProxy(UPS, speculate_s=5.0)
    prompt = {"prompt": list(range(1, 66))}
    first, predicted = proxy._route(prompt, "completions")
    assert predicted[first[0]] == 0
    proxy.core.started(first[0])  # in flight: plain load balancing would pick another engine
    again, predicted = proxy._route(prompt, "completions")
    assert again[0] == first[0] and predicted[first[0]] == 64


def test_the_held_bytes_bound_refuses_what_does_not_fit_and_counts_it() -> None:
    budget = ByteBudget(100)
    assert budget.take(60) and budget.take(40) and not budget.take(1)
    budget.give(60)
    assert budget.held == 40 and budget.peak == 100 and budget.refused == 1 and budget.take(60)
    with pytest.raises(ValueError, match="at least 1 byte"):
        ByteBudget(0)


def test_a_batch_of_prompts_goes_to_one_engine_by_its_summed_prefix_and_predicts_the_last() -> None:
    proxy = KVProxy(UPS)
    ix = proxy.router.index
    a, b = list(range(1, 65)), list(range(100, 164))
    ix.speculate("b", a, 0.0, 60.0)
    ix.speculate("c", b, 0.0, 60.0)
    ix.speculate("b", b[:32], 0.0, 60.0)
    ranking, predicted = proxy._route({"prompt": [a, b]}, "completions")
    assert ranking[0] == "b"  # 64 + 32 cached tokens beat c's 64
    assert predicted["b"] == 32 and predicted["c"] == 48  # the last prompt's, capped below its end


def test_round_robin_ignores_the_prefix_but_still_predicts() -> None:
    proxy = KVProxy(UPS, policy="round-robin")
    order = [proxy._route({"prompt": [1] * 40}, "completions")[0][0] for _ in range(4)]
    assert order == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="unknown policy"):
        KVProxy(UPS, policy="fastest")
