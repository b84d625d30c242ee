"""Property: an index built from several simulated engines' event streams scores every
prompt exactly as the engines' own pools would (their longest cached prefix), through
eviction churn, prefix-cache resets, restarts, replayed gaps and stale-then-snapshot
recovery; with engines of different block sizes (16 and 32) sharing one index, and
salted requests that must never match unsalted blocks.

Single-block prompts (exactly one block, so a cached one is recomputed into a second
physical copy stored from block 0) and report-mode requests (vLLM's
``kv_cache_report_mode="full"``: the cached prefix is re-announced, with the request's
``session_id``, on every admission attempt, without changing the pool) are mixed in, and
the index runs with its default re-announcement rule: residency must stay exact.
(Report mode is emulated here on top of the real pool, as vLLM 0.33 does it: a
``BlockStored`` of the hit blocks from block 0 before the admission's own events. It is
used for prompts of more than one block: a report-mode prompt of exactly one block is
the documented ambiguous case, see ``test_a_recomputed_one_block_report_mode_prompt...``.)"""

from __future__ import annotations

import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.hashing import BlockHasher, to_external_list
from kvstream.routing.index import KVIndex
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool

R = 16
_SEEN = [0, 0]  # probes with an empty / non-empty expected prefix (see the last test)
SEGMENTS = [[1000 * s + i for i in range(16)] for s in range(6)]  # shared 16-token pieces


class _Engine:
    def __init__(self, name: str, block_size: int, blocks: int) -> None:
        self.name = name
        self.bs = block_size
        self.blocks = blocks
        self.restart()

    def restart(self) -> None:
        self.pool = BlockPool(self.blocks, self.bs)
        self.mgr = KVCacheManager(self.pool, BlockHasher("xxhash", self.bs, seed="0"))
        self.running: list = []
        self.n = 0
        self.pre: list = []  # events of this step that come before the manager's

    def cached_prefix(self, prompt: list[int], salt: str | None) -> int:
        """The pool's longest cached prefix of ``prompt``, in router blocks."""
        req = self.mgr.new_request("probe", prompt, cache_salt=salt)
        k = 0
        for h in req.block_hashes:
            if self.pool.lookup(h) is None:
                break
            k += 1
        return k * (self.bs // R)


def _prompt(rnd: random.Random) -> list[int]:
    if rnd.random() < 0.25:
        return list(SEGMENTS[rnd.randrange(3)])  # exactly one 16-token block
    segs = [SEGMENTS[rnd.randrange(3)]] + [SEGMENTS[rnd.randrange(6)] for _ in range(rnd.randrange(4))]
    return [t for s in segs for t in s] + [rnd.randrange(50) for _ in range(rnd.randrange(20))]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "free", "decode", "reset", "restart", "gap", "stale"]),
        st.integers(0, 2),
        st.integers(0, 2**32),
    ),
    min_size=5,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_index_scores_every_prompt_like_the_engines_pools(ops) -> None:
    engines = [_Engine("e0", 16, 12), _Engine("e1", 16, 20), _Engine("e2", 32, 10)]
    run_against_pools(ops, KVIndex(router_block_size=R), engines)


def run_against_pools(ops, index, engines: list[_Engine]) -> None:
    """Drive ``engines`` through ``ops`` and check after every op that ``index`` (any router
    index class) scores the recent probe prompts exactly as each engine's pool holds them."""
    backlog: dict[str, list[KVEventBatch]] = {e.name: [] for e in engines}
    stale: set[str] = set()
    probes: list[tuple[list[int], str | None]] = []
    ts = 0.0

    def publish(e: _Engine) -> None:
        nonlocal ts
        evs = e.pre + e.mgr.take_events()
        e.pre = []
        if evs:
            ts += 1
            backlog[e.name].append(KVEventBatch(ts, evs))
            if not gapped.get(e.name):
                for b in backlog[e.name]:
                    index.apply_batch(e.name, b)
                backlog[e.name].clear()

    gapped: dict[str, int] = {}
    for op, which, seed in ops:
        rnd = random.Random(seed)
        e = engines[which]
        if op == "admit":
            salt = "tenant" if rnd.random() < 0.2 else None
            prompt = _prompt(rnd)
            probes.append((prompt, salt))
            e.n += 1
            req = e.mgr.new_request(f"r{e.n}", prompt, cache_salt=salt)
            report = len(prompt) > e.bs and rnd.random() < 0.5

            def attempt() -> bool:
                e.pre += e.mgr.take_events()
                if report:  # vLLM re-announces the hit prefix on every admission attempt
                    hits = len(e.mgr.get_computed_blocks(req))
                    if hits:
                        e.pre.append(BlockStored(
                            to_external_list(req.block_hashes[:hits]), None, prompt[: hits * e.bs], e.bs,
                            None, "GPU", None, session_id="sess"))
                ok = e.mgr.admit(req)
                if report:  # the request's own new blocks carry its session id too
                    # Copies: the pool keeps its events (snapshot_events rebuilds from them),
                    # and a snapshot is no request's report.
                    e.pre += [msgspec.structs.replace(ev, session_id="sess") if type(ev) is BlockStored else ev
                              for ev in e.mgr.take_events()]
                return ok

            # A full pool finishes its oldest requests first (as a scheduler would), so
            # their cached blocks get evicted and reused: BlockRemoved churn.
            admitted = attempt()
            while not admitted and e.running:
                e.mgr.free(e.running.pop(0))
                admitted = attempt()
            if admitted:
                e.running.append(req)
        elif op == "free" and e.running:
            e.mgr.free(e.running.pop(rnd.randrange(len(e.running))))
        elif op == "decode" and e.running:
            req = e.running[rnd.randrange(len(e.running))]
            for _ in range(rnd.randrange(1, 20)):
                if not e.mgr.decode(req, rnd.randrange(50)):
                    break
        elif op == "reset":
            for req in e.running:
                e.mgr.free(req)
            e.running.clear()
            e.mgr.reset_prefix_cache()
        elif op == "restart":
            e.restart()
            backlog[e.name].clear()
            gapped.pop(e.name, None)
            index.clear_source(e.name)  # what SourceReset(reason="restart") does
            stale.discard(e.name)
        elif op == "gap":
            # Live batches stop arriving for a while; the replay later delivers them in order.
            gapped[e.name] = 1 + rnd.randrange(3)
        elif op == "stale" and e.name not in stale:
            # Unrecoverable loss: stale until a snapshot rebuilds the state.
            stale.add(e.name)
            index.mark_stale(e.name)
            publish(e)
            e.mgr.take_events()
            index.clear_source(e.name)  # SourceReset(reason="snapshot"), then the snapshot
            index.apply_batch(e.name, KVEventBatch(ts, e.pool.snapshot_events()))
            backlog[e.name].clear()
            gapped.pop(e.name, None)
            stale.discard(e.name)
        publish(e)
        for name in list(gapped):
            gapped[name] -= 1
            if gapped[name] <= 0:
                del gapped[name]
                for b in backlog[name]:
                    index.apply_batch(name, b)
                backlog[name].clear()
        for prompt, salt in probes[-6:]:
            m = index.match(prompt, salt=salt)
            for eng in engines:
                if eng.name in gapped:
                    continue
                got = m[eng.name].tier_blocks.get("GPU", 0) if eng.name in m else 0
                want = eng.cached_prefix(prompt, salt)
                assert got == want, (eng.name, op, salt)
                _SEEN[want > 0] += 1
    assert index.stats.rejected_events == 0
    assert index.stats.unknown_removed == 0


def test_the_property_run_exercised_real_prefix_hits() -> None:
    # Guards against a vacuous property: the probes above must have seen cached prefixes.
    if sum(_SEEN) == 0:
        test_index_scores_every_prompt_like_the_engines_pools()
    assert _SEEN[1] > 0 and _SEEN[0] > 0, _SEEN


def _seeded_ops(seed: int, n: int = 50) -> list:
    rnd = random.Random(seed)
    kinds = ["admit", "admit", "admit", "free", "decode", "reset", "restart", "gap", "stale"]
    return [(rnd.choice(kinds), rnd.randrange(3), rnd.randrange(2**32)) for _ in range(n)]


def _exact(rule: str, seed: int) -> bool:
    engines = [_Engine("e0", 16, 12), _Engine("e1", 16, 20), _Engine("e2", 32, 10)]
    try:
        run_against_pools(_seeded_ops(seed), KVIndex(router_block_size=R, reannounce=rule), engines)
    except AssertionError:
        return False
    return True


def test_the_default_reannounce_rule_is_exact_through_restarts_one_block_prompts_and_report_mode() -> None:
    # Issue #15 item 4: after restarts, one-block prompts recomputed from block 0 were
    # taken for re-announcements ("detect"), and a later removal dropped a block the
    # engine still held. Counting every store ("count") over-counts report-mode
    # re-announcements instead. The default ("session") must be exact on every seed...
    seeds = range(100)
    assert all(_exact("session", s) for s in seeds)
    # ...and these seeds must really contain both situations: each other rule fails one.
    assert not all(_exact("detect", s) for s in seeds)
    assert not all(_exact("count", s) for s in seeds)


def test_a_recomputed_one_block_report_mode_prompt_is_the_one_documented_under_count() -> None:
    # A report-mode request whose prompt is exactly one cached block recomputes it: a
    # real second copy that looks exactly like a re-announcement (block 0, all held,
    # session id). The index under-counts it by one copy: it may miss, never over-route.
    idx = KVIndex(router_block_size=R)
    p = SEGMENTS[0]
    first = BlockStored([7], None, p, 16, None, "GPU", None, session_id="sess")
    idx.apply_batch("e", KVEventBatch(1.0, [first]))
    idx.apply_batch("e", KVEventBatch(2.0, [BlockStored([7], None, p, 16, None, "GPU", None, session_id="sess")]))
    assert idx.state()["sources"]["e"]["blocks"] == (("GPU", 0, 7, 1),)
    # Without a session id (no report mode) the same event is the second copy it is.
    idx.apply_batch("e", KVEventBatch(3.0, [BlockStored([7], None, p, 16, None, "GPU", None)]))
    assert idx.state()["sources"]["e"]["blocks"] == (("GPU", 0, 7, 2),)
