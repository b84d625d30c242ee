"""The placement model (CostPolicy): the cheapest engine in tokens of work, a seeded spread."""

from __future__ import annotations

from collections import Counter

import pytest

from kvstream.routing.scoring import CostPolicy, Load, RecentPlacements, SourceMatch, rank


def m(source: str, blocks: int = 0, cpu: int = 0) -> SourceMatch:
    served = {k: v for k, v in (("GPU", blocks), ("CPU", cpu)) if v}
    return SourceMatch(source, blocks + cpu, (blocks + cpu) * 16, {}, served)


def best(policy: CostPolicy, matches: list[SourceMatch], loads: dict[str, Load], n: int) -> str:
    return rank(policy(matches, loads, n), loads)[0]


def test_a_cached_prefix_wins_when_the_engines_are_equally_busy() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    assert best(pol, [m("a"), m("b", 50)], {}, 64) == "b"
    assert pol.costs([m("a"), m("b", 50)], {}, 64) == {"a": 1024, "b": 1024 - 800}


def test_queued_prefill_outweighs_a_prefix_worth_less_than_it() -> None:
    pol = CostPolicy(prefill_weight=1.0, spread_tokens=0, spread_share=0)
    matches = [m("a"), m("b", 50)]  # b saves 800 tokens
    assert best(pol, matches, {"b": Load(prefill_tokens=700)}, 64) == "b"
    assert best(pol, matches, {"b": Load(prefill_tokens=900)}, 64) == "a"


def test_by_default_a_miss_costs_four_times_the_queued_prefill_it_avoids() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    matches = [m("a"), m("b", 50)]  # b saves 800 tokens
    assert best(pol, matches, {"b": Load(prefill_tokens=3000)}, 64) == "b"
    assert best(pol, matches, {"b": Load(prefill_tokens=3300)}, 64) == "a"


def test_new_content_goes_to_the_engine_that_got_the_least_new_work_lately() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    # A new prompt with a shared 10-block system prompt cached on "a" only (10 of 64
    # blocks: far below the stick share): "a" got 4,000 tokens of new work lately, "b" none.
    matches = [m("a", 10), m("b")]
    loads = {"a": Load(placed_tokens=4000)}
    assert best(pol, matches, loads, 64) == "b"
    # Equal new work: the system prompt decides.
    assert best(pol, matches, {"a": Load(placed_tokens=4000), "b": Load(placed_tokens=4000)}, 64) == "a"


def test_a_conversation_whose_history_is_cached_stays_whatever_the_balance() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    matches = [m("a", 60), m("b")]  # 60 of 64 blocks: above the stick share
    assert pol.costs(matches, {"a": Load(placed_tokens=50_000)}, 64)["a"] == 4 * 16
    assert best(pol, matches, {"a": Load(placed_tokens=50_000)}, 64) == "a"


def test_the_balance_term_fades_between_half_the_stick_share_and_the_stick_share() -> None:
    pol = CostPolicy(stick_share=0.8, spread_tokens=0, spread_share=0)
    loads = {"a": Load(placed_tokens=1000)}
    # best cached share 0.4 (on b): full weight (placed_weight 1.0); 0.6: half of it; 0.8 and more: none.
    for blocks, balance in ((40, 1.0), (60, 0.5), (80, 0.0), (90, 0.0)):
        c = pol.costs([m("a"), m("b", blocks)], loads, 100)
        assert c["a"] == pytest.approx(1600 + balance * 1.0 * 1000)


def test_recent_placements_age_by_the_horizon_and_count_only_new_work() -> None:
    rp = RecentPlacements(horizon=4, request_tokens=0)  # tokens alone (the per-request charge: below)
    rp.placed("a", 1000)
    rp.placed("b", 0)  # a fully cached request: no new work, but it ages the sums
    assert rp.get("a") == pytest.approx(750) and rp.get("b") == 0 and rp.get("c") == 0
    for _ in range(40):
        rp.placed("b", 100)
    assert rp.get("a") < 1 and rp.get("b") == pytest.approx(400, rel=0.01)  # 100 / (1 - 3/4)
    rp.forget("b")
    assert rp.get("b") == 0
    with pytest.raises(ValueError, match="horizon"):
        RecentPlacements(horizon=0.5)
    with pytest.raises(ValueError, match="request_tokens"):
        RecentPlacements(request_tokens=-1)


def test_a_placement_weighs_its_tokens_plus_a_per_request_charge() -> None:
    rp = RecentPlacements(horizon=1e9)  # no ageing to speak of
    assert rp.request_tokens == 256  # the default
    rp.placed("a", 2000)  # one large conversation
    for _ in range(2):
        rp.placed("b", 900)  # two smaller ones: 1,800 tokens, fewer than a's
    assert rp.get("a") == pytest.approx(2256) and rp.get("b") == pytest.approx(2312)
    # So a new conversation goes to "a", which holds fewer of them, though it got more tokens.
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    loads = {s: Load(placed_tokens=rp.get(s)) for s in "ab"}
    assert best(pol, [m("a"), m("b")], loads, 64) == "a"
    assert best(pol, [m("a"), m("b")], {"a": Load(placed_tokens=2000), "b": Load(placed_tokens=1800)}, 64) == "b"


def test_waiting_and_running_requests_count_as_their_token_equivalents() -> None:
    pol = CostPolicy(queue_tokens=512, running_tokens=16, spread_tokens=0, spread_share=0)  # explicit weights
    c = pol.costs([m("a")], {"a": Load(queue=2, running=3)}, 10)
    assert c == {"a": 160 + 2 * 512 + 3 * 16}


def test_a_cpu_block_is_worth_its_tier_weight() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    assert pol.costs([m("a", cpu=10)], {}, 10) == {"a": pytest.approx(160 - 10 * 16 * 0.8)}


def test_equal_engines_share_the_traffic_and_the_same_seed_repeats_the_choices() -> None:
    matches = [m("e0"), m("e1"), m("e2"), m("e3")]

    def run(seed: int) -> list[str]:
        pol = CostPolicy(seed=seed)
        return [best(pol, matches, {}, 64) for _ in range(400)]

    picks = run(7)
    assert picks == run(7) and picks != run(8)
    counts = Counter(picks)
    assert set(counts) == {"e0", "e1", "e2", "e3"} and min(counts.values()) > 60


def test_the_spread_never_picks_an_engine_that_is_clearly_worse() -> None:
    pol = CostPolicy(spread_tokens=32, spread_share=0.0)
    matches = [m("a"), m("b", 2), m("c", 40)]  # c saves 640 tokens
    assert {best(pol, matches, {}, 64) for _ in range(200)} == {"c"}
    near = [m("a"), m("b", 1)]  # 16 tokens apart: within the spread
    assert {best(pol, near, {}, 64) for _ in range(200)} == {"a", "b"}


def test_the_failover_order_after_the_pick_is_by_cost() -> None:
    pol = CostPolicy(spread_tokens=0, spread_share=0)
    loads = {"a": Load(prefill_tokens=100), "b": Load(prefill_tokens=300), "c": Load(prefill_tokens=200)}
    assert rank(pol([m("a"), m("b"), m("c")], loads, 8), loads) == ["a", "c", "b"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        CostPolicy(block_size=0)
    with pytest.raises(ValueError, match="prefill_weight"):
        CostPolicy(prefill_weight=-1)
    with pytest.raises(ValueError, match="placed_weight"):
        CostPolicy(placed_weight=-1)
    with pytest.raises(ValueError, match="stick_share"):
        CostPolicy(stick_share=0)
