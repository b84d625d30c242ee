"""The emulated engine's core (sans-IO), driven step by step with explicit times."""

from __future__ import annotations

import math

import pytest

from kvstream.emulator.core import EmulatedEngine, EmulatorConfig, Generation
from kvstream.wire.events import BlockStored
from kvstream.proxy.openai import OpenAIError


def run(eng: EmulatedEngine, gens: list[Generation], t: float = 0.0) -> tuple[float, list[object]]:
    events: list[object] = []
    while not all(g.finished for g in gens):
        assert eng.wakeup < math.inf
        t = max(t, eng.wakeup)
        ev, _ = eng.step(t)
        events += ev
    return t, events


def test_prefix_hit_is_reported_as_cached_tokens_and_skips_prefill_time() -> None:
    cfg = EmulatorConfig(num_gpu_blocks=64, block_size=16, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0)
    eng = EmulatedEngine(cfg)
    prompt = list(range(1, 401))  # 400 tokens: 25 blocks
    a = eng.submit(prompt, 4, 0.0)
    t, events = run(eng, [a])
    assert a.cached_tokens == 0 and a.delivered == 4
    assert a.first_token_at == pytest.approx(0.01 + 0.4)  # one step + 400 tokens at 1000/s
    assert sum(1 for e in events if type(e) is BlockStored) >= 1
    b = eng.submit(prompt, 4, t)
    run(eng, [b], t)
    # 399 tokens may be reused at most (the last one is always computed): 24 blocks.
    assert b.cached_tokens == 384
    assert b.first_token_at - b.submitted_at == pytest.approx(0.01 + 16 / 1000)
    assert b.output == a.output  # deterministic: same prompt, same output
    assert eng.prefix_hits == 384 and eng.prefix_queries == 800


def test_outputs_depend_on_seed_and_prompt() -> None:
    e0, e1 = EmulatedEngine(EmulatorConfig(seed=0)), EmulatedEngine(EmulatorConfig(seed=1))
    assert e0.output_tokens([1, 2, 3], 8) == EmulatedEngine(EmulatorConfig(seed=0)).output_tokens([1, 2, 3], 8)
    assert e0.output_tokens([1, 2, 3], 8) != e1.output_tokens([1, 2, 3], 8)
    assert e0.output_tokens([1, 2, 3], 8) != e0.output_tokens([1, 2, 4], 8)


def test_too_long_requests_are_refused_before_anything_is_queued() -> None:
    eng = EmulatedEngine(EmulatorConfig(num_gpu_blocks=6, block_size=16, max_model_len=100))
    with pytest.raises(OpenAIError, match="maximum context length is 100 tokens"):
        eng.submit([1] * 90, 20, 0.0)
    with pytest.raises(OpenAIError, match="KV blocks"):
        eng.submit([1] * 90, 10, 0.0)  # 100 tokens need 7 blocks; 5 are usable
    with pytest.raises(OpenAIError, match="max_tokens"):
        eng.submit([1], 0, 0.0)
    assert eng.num_waiting == 0 and eng.counters["requests"] == 0


def test_preemption_under_memory_pressure_still_finishes_everything() -> None:
    cfg = EmulatorConfig(num_gpu_blocks=12, block_size=16, decode_tokens_per_s=1000.0)
    eng = EmulatedEngine(cfg)
    gens = [eng.submit([i + 1] * 60, 40, 0.0) for i in range(3)]  # 100 tokens each: 7 blocks
    run(eng, gens)
    assert all(g.delivered == 40 for g in gens)
    assert eng.preemptions > 0
    assert eng.kv_usage == 0.0


def test_abort_frees_the_blocks_of_a_running_request() -> None:
    eng = EmulatedEngine(EmulatorConfig(num_gpu_blocks=64))
    g = eng.submit(list(range(100)), 50, 0.0)
    eng.step(0.0)
    assert eng.num_running == 1 and eng.kv_usage > 0
    eng.abort(g, 0.05)
    assert g.finished and g.aborted and eng.num_running == 0 and eng.kv_usage == 0.0
    eng.step(eng.wakeup if eng.wakeup < math.inf else 0.1)
    assert eng.wakeup == math.inf
