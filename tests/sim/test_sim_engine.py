"""The simulated engine: scheduling, timing, prefix hits, preemption, decode runs."""

from __future__ import annotations

import heapq
import math
from typing import Any

import pytest

from kvstream.wire.events import BlockRemoved, BlockStored
from kvstream.hashing import BlockHasher
from kvstream.sim.blocks import SegmentHasher, SegmentTokens
from kvstream.sim.engine import EngineConfig, EngineModel, SimRequestState
from kvstream.sim.metrics import RunMetrics
from kvstream.sim.workload import SimRequest, SyntheticConfig, WorkloadError, expand_segments, synthetic_workload


def _drive(reqs: list[SimRequest], config: EngineConfig, engines: int = 1) -> tuple[list[EngineModel], RunMetrics, list[tuple[int, float, list[Any]]], list[SimRequestState]]:
    """Round-robin ``reqs`` over ``engines`` engines; returns engines, metrics, batches, states."""
    hasher = SegmentHasher(config.block_hasher())
    metrics = RunMetrics(engines)
    es = [EngineModel(i, config, hasher, metrics) for i in range(engines)]
    heap: list[tuple[float, int]] = []
    batches: list[tuple[int, float, list[Any]]] = []
    states = []

    def advance(until: float) -> None:
        while heap and heap[0][0] <= until:
            t, i = heapq.heappop(heap)
            e = es[i]
            if e.wakeup != t:
                continue
            ev = e.step(t)
            if ev:
                batches.append((i, t, ev))
            if e.wakeup != math.inf:
                heapq.heappush(heap, (e.wakeup, i))

    for k, r in enumerate(reqs):
        advance(r.arrival)
        i = k % engines
        st = SimRequestState(r, i, r.arrival)
        states.append(st)
        before = es[i].wakeup
        if es[i].submit(st, r.arrival):
            metrics.routed[i] += 1
        if es[i].wakeup not in (before, math.inf):
            heapq.heappush(heap, (es[i].wakeup, i))
    advance(math.inf)
    for e in es:
        e.manager.pool.check_invariants()
    return es, metrics, batches, states


def _req(i: int, arrival: float, prompt: tuple[tuple[int, int], ...], out: int) -> SimRequest:
    return SimRequest(i, arrival, prompt, (1 << 61) | i, out)


CFG = EngineConfig(num_blocks=256, block_size=16, prefill_rate=1000.0, decode_step_s=0.01,
                   max_running=8, max_batched_tokens=512)


def test_single_request_timing_follows_prefill_rate_and_step_cost() -> None:
    r = _req(0, 1.0, ((5, 100),), 10)
    (e,), m, batches, (st,) = _drive([r], CFG)
    assert st.admitted_at == 1.0
    assert st.first_token_at == pytest.approx(1.0 + 0.01 + 100 / 1000.0)
    # 9 more tokens, one step of 10 ms each, then freed at the next step boundary
    assert st.finished_at == pytest.approx(st.first_token_at + 9 * 0.01)
    assert m.completed == 1 and m.output_tokens == 10
    assert m.ttfts == [pytest.approx(0.11)]
    stored = [ev for _, _, evs in batches for ev in evs if isinstance(ev, BlockStored)]
    # 100 prompt tokens: 6 full blocks cached at admission; 109 tokens with slots: 6 blocks
    assert sum(len(ev.block_hashes) for ev in stored) == 6
    assert stored[0].token_ids == expand_segments(r.prompt)[:96]


def test_second_request_with_shared_prefix_hits_the_cache() -> None:
    a = _req(0, 0.0, ((7, 64), (8, 40)), 2)
    b = _req(1, 5.0, ((7, 64), (9, 40)), 2)
    (_,), m, _, (sa, sb) = _drive([a, b], CFG)
    assert m.prompt_tokens == 208
    assert m.hit_tokens == 64
    # b computes 40 tokens, a 104
    assert m.prefill_per_engine == [144]
    assert sb.first_token_at - sb.req.arrival == pytest.approx(0.01 + 40 / 1000.0)


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    r = _req(0, 0.0, ((3, 1200),), 1)
    (_,), m, batches, (st,) = _drive([r], CFG)
    # 512 + 512 + 176 tokens: three steps
    assert st.first_token_at == pytest.approx(3 * 0.01 + 1200 / 1000.0)
    assert len(batches) == 3
    assert m.completed == 1


def test_memory_pressure_preempts_newest_and_everything_completes() -> None:
    cfg = EngineConfig(num_blocks=40, block_size=16, prefill_rate=1e6, decode_step_s=0.01,
                       max_running=8, max_batched_tokens=4096)
    reqs = [_req(i, 0.0, ((100 + i, 100),), 120) for i in range(6)]
    (e,), m, batches, states = _drive(reqs, cfg)
    assert m.preemptions > 0
    assert m.completed == 6
    assert all(s.finished_at > 0 for s in states)
    assert any(s.preemptions for s in states)
    assert not e.running and not e.waiting
    removed = [ev for _, _, evs in batches for ev in evs if isinstance(ev, BlockRemoved)]
    assert removed, "a full pool evicts cached blocks"


def test_request_larger_than_the_cache_is_rejected() -> None:
    cfg = EngineConfig(num_blocks=8, block_size=16)
    (e,), m, _, _ = _drive([_req(0, 0.0, ((1, 200),), 1)], cfg)
    assert e.rejected == 1 and m.completed == 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_runs_give_the_same_results_as_single_steps(block_size: int) -> None:
    reqs = synthetic_workload(SyntheticConfig(requests=120, duration=4.0, seed=2,
                                              system_prompt_tokens=200, output_tokens_mean=90))
    kw = dict(num_blocks=4800 // block_size, block_size=block_size, prefill_rate=20000.0, decode_step_s=0.02,
              max_running=16, max_batched_tokens=2048)
    fast = _drive(reqs, EngineConfig(**kw, coalesce=True), engines=2)
    slow = _drive(reqs, EngineConfig(**kw, coalesce=False), engines=2)
    fm, sm = fast[1], slow[1]
    fd, sd = fm.summary("x", 120).deterministic(), sm.summary("x", 120).deterministic()
    # t + k*d and k additions of d differ in the last float bits: times compare approximately
    for k, v in fd.items():
        assert (v == pytest.approx(sd[k], rel=1e-9)) if isinstance(v, float) else (v == sd[k]), k
    # the same events, at the same times, per engine
    def flat(batches: list[tuple[int, float, list[Any]]]) -> list[tuple[int, float, Any]]:
        return [(i, round(t, 9), ev) for i, t, evs in batches for ev in evs]
    assert flat(fast[2]) == flat(slow[2])
    assert sum(e.steps for e in fast[0]) < sum(e.steps for e in slow[0])
    assert fm.preemptions > 0  # the comparison covered preemption too


def test_token_granularity_divides_tokens_but_keeps_blocks() -> None:
    r = _req(0, 0.0, ((5, 512), (6, 512)), 64)
    (_,), m1, b1, (st1,) = _drive([r], EngineConfig(block_size=512))
    (_,), m32, b32, (st32,) = _drive([r], EngineConfig(block_size=512, token_granularity=32))
    # a simulated step stands for 32 real ones: first-token and finish times are kept
    assert st32.first_token_at == pytest.approx(st1.first_token_at)
    assert st32.finished_at == pytest.approx(st1.finished_at)
    s1 = [ev for _, _, evs in b1 for ev in evs]
    s32 = [ev for _, _, evs in b32 for ev in evs]
    assert [len(e.block_hashes) for e in s1] == [len(e.block_hashes) for e in s32]
    assert len(s32[0].token_ids) * 32 == len(s1[0].token_ids)
    assert m1.prefill_per_engine == m32.prefill_per_engine == [1024]
    with pytest.raises(WorkloadError, match="multiple of token_granularity"):
        EngineConfig(block_size=16, token_granularity=3)


def test_segment_hasher_matches_plain_block_hashing() -> None:
    bh = BlockHasher("native", 16)
    sh = SegmentHasher(bh)
    for r in synthetic_workload(SyntheticConfig(requests=60, seed=5)):
        segs = r.prompt + ((r.output_key, r.output_len),)
        toks = expand_segments(segs)
        assert sh.hashes(segs) == bh.hash_blocks(toks)
        st = SegmentTokens(segs)
        assert len(st) == len(toks) and st[17:333] == toks[17:333] and st.toarray().tolist() == toks
    assert sh.hits > 0
