"""A hypothesis state machine: KVIndex() (the native table, whose common cases the native
core applies), KVIndex over a generic table (every rule in Python) and EngineKeyIndex against a small model that is obviously right, under random sequences of
events and calls.

The model is a dict ``(source, medium, group, engine hash) -> copies``, plus, for token
keying, which held hashes have a router key (a run stored with tokens whose parent has one,
or no parent; a key lasts while anyone holds the hash, and a block waiting for its parent
gets one when the parent does). Prompts are the paths of a small tree of blocks, in three
namespaces (plain, a LoRA adapter, a cache salt), hashed by kvstream's ``BlockHasher``,
so all three indexes can match them.

Rules: ``BlockStored`` runs with known or unknown parents, in any group, on the GPU with
tokens or as tier-only CPU events; the same run stored twice and removed once (copies);
``BlockRemoved`` of unknown blocks (counted); ``AllBlocksCleared`` (GPU tier only);
``mark_stale`` / ``clear_source`` / ``remove_source``; time passing under a TTL; dump /
load round trips. After every step: ``state()`` equals the model (and the native and
generic tables agree on everything, unlinked blocks included), the counters agree, and
every prompt's ``match`` and ``score`` equal the model's (token keying: only blocks with a
router key count). A second machine bounds the index in bytes: whatever eviction drops,
the index never claims a copy the model does not hold."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstream.hashing import BlockHasher, LoRA, RequestBlockHasher, to_external_list
from kvstream.routing.engine_index import EngineKeyIndex
from kvstream.routing.index import KVIndex
from kvstream.routing.scoring import Load
from kvstream.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.routing.generic_table import BytesStoreTable

BS = 16
HASHER = BlockHasher("xxhash", BS, seed="0")
SOURCES = ["e0", "e1", "e2"]
ADAPTER = LoRA("adapter-a", "/adapters/a", 3)
# (lora for EngineKeyIndex, lora for KVIndex, salt)
NAMESPACES = [(None, None, None), (ADAPTER, "adapter-a", None), (None, None, "tenant-1")]
# A tree of 4-block prompts: two roots of 2 blocks, each with two 2-block branches.
PROMPTS = [[r * 1000 + i for i in range(2 * BS)] + [r * 1000 + 100 * (b + 1) + i for i in range(2 * BS)]
           for r in range(2) for b in range(2)]
NBLOCKS = 4


class _Chain:
    """One prompt in one namespace: its engine hashes, tokens and wire extra keys."""

    def __init__(self, ns: int, prompt: list[int]) -> None:
        lora, self.lora_name, salt = NAMESPACES[ns]
        self.ns = ns
        self.prompt = prompt
        rh = RequestBlockHasher(HASHER, lora=lora, cache_salt=salt)
        rh.extend(prompt)
        self.hashes = to_external_list(rh.block_hashes)
        self.extra = rh.wire_extra_keys
        self.lora_id = lora.int_id if lora is not None else None

    def __repr__(self) -> str:
        return f"<prompt {PROMPTS.index(self.prompt)} in namespace {self.ns}>"

    def stored(self, start: int, n: int, medium: str, group: int) -> BlockStored:
        hs = self.hashes[start:start + n]
        parent = self.hashes[start - 1] if start else None
        if medium == "CPU":  # an offload event: no tokens, block_size 0, no parent
            return BlockStored(hs, None, [], 0, None, "CPU", None, None, group)
        extra = self.extra[start:start + n]
        return BlockStored(hs, parent, self.prompt[start * BS:(start + n) * BS], BS, self.lora_id, "GPU",
                           self.lora_name, extra if any(e is not None for e in extra) else None, group)


CHAINS = [_Chain(ns, p) for ns in range(len(NAMESPACES)) for p in PROMPTS]
PARENT = {h: (c.hashes[j - 1] if j else None) for c in CHAINS for j, h in enumerate(c.hashes)}


class Model:
    """Residency as counted copies, which hashes have a router key, and the TTL."""

    def __init__(self, ttl_s: float | None = None) -> None:
        self.copies: Counter[tuple[str, str, int, int]] = Counter()
        self.stale: dict[str, bool] = {}
        self.keyed: set[int] = set()
        self.waiting: set[int] = set()  # stored with tokens, parent has no key yet
        self.unknown_removed = 0
        self.ttl_s = ttl_s
        self.gen_start: float | None = None
        self.touched: set[int] = set()

    def held(self, h: int) -> bool:
        return any(k[3] == h for k in self.copies)

    def _forget_if_free(self, h: int) -> None:
        if not self.held(h):
            self.keyed.discard(h)
            self.waiting.discard(h)

    def _key(self, h: int) -> None:
        """``h`` gets its router key; blocks waiting for it get theirs."""
        todo = [h]
        while todo:
            x = todo.pop()
            self.keyed.add(x)
            self.waiting.discard(x)
            todo += [w for w in self.waiting if PARENT[w] == x]

    def tick(self, now: float) -> None:
        if self.ttl_s is None:
            return
        if self.gen_start is None:
            self.gen_start = now
            return
        if now - self.gen_start < self.ttl_s:
            return
        for k in [k for k in self.copies if k[3] not in self.touched]:
            del self.copies[k]
        for h in list(self.keyed | self.waiting):
            self._forget_if_free(h)
        self.touched = set()
        self.gen_start = now

    def store(self, src: str, ev: BlockStored) -> None:
        self.stale.setdefault(src, False)
        medium = ev.medium or "GPU"
        parent = ev.parent_block_hash
        for h in ev.block_hashes:
            self.copies[(src, medium, ev.group_idx or 0, h)] += 1
            self.touched.add(h)
            if ev.token_ids and h not in self.keyed:
                if parent is None or parent in self.keyed:
                    self._key(h)
                else:
                    self.waiting.add(h)
            parent = h

    def reannounced(self, src: str, ev: BlockStored) -> bool:
        """A report-mode re-announcement (``session_id``, from block 0, every block held
        already in that medium and group): no copy (the TTL is refreshed: it is a store)."""
        g = ev.group_idx or 0
        return (ev.session_id is not None and ev.parent_block_hash is None
                and all(self.copies.get((src, ev.medium or "GPU", g, h)) for h in ev.block_hashes))

    def remove(self, src: str, ev: BlockRemoved) -> None:
        self.stale.setdefault(src, False)
        for h in ev.block_hashes:
            k = (src, ev.medium or "GPU", ev.group_idx or 0, h)
            if self.copies[k]:
                self.copies[k] -= 1
                if not self.copies[k]:
                    del self.copies[k]
                    self._forget_if_free(h)
            else:
                self.copies.pop(k, None)
                self.unknown_removed += 1

    def clear(self, src: str, media: tuple[str, ...] = ("GPU", "CPU")) -> None:
        gone = {k[3] for k in self.copies if k[0] == src and k[1] in media}
        for k in [k for k in self.copies if k[0] == src and k[1] in media]:
            del self.copies[k]
        for h in gone:
            self._forget_if_free(h)

    def rows(self, src: str) -> tuple:
        return tuple(sorted((m, g, h, n) for (s, m, g, h), n in self.copies.items() if s == src))

    def sources_state(self) -> dict[str, Any]:
        return {s: {"stale": st_, "blocks": self.rows(s)} for s, st_ in self.stale.items()}

    def match(self, chain: _Chain, tokens: bool) -> dict[str, tuple]:
        out = {}
        for s, stale in self.stale.items():
            if stale:
                out[s] = (0, {}, {}, True)
                continue
            tiers: dict[str, int] = {}
            served: dict[str, int] = {}
            n = 0
            for m in ("GPU", "CPU"):
                k = 0
                for h in chain.hashes:
                    if (tokens and h not in self.keyed) or not any(
                            self.copies.get((s, m, g, h)) for g in (0, 1)):
                        break
                    k += 1
                if k:
                    tiers[m] = k
            for h in chain.hashes:
                where = [m for m in ("GPU", "CPU") if (not tokens or h in self.keyed)
                         and any(self.copies.get((s, m, g, h)) for g in (0, 1))]
                if not where:
                    break
                n += 1
                served[where[0]] = served.get(where[0], 0) + 1
            out[s] = (n, tiers, served, False)
        return out


def _seen(match: dict[str, Any]) -> dict[str, tuple]:
    return {s: (m.blocks, dict(m.tier_blocks), dict(m.served), m.stale) for s, m in match.items()}


class IndexMachine(RuleBasedStateMachine):
    TTL_S: float | None = None
    STEP_S = 0.0  # seconds each batch advances the clock (beside the time_passes rule)

    KW: dict[str, Any] = {}

    def __init__(self) -> None:
        super().__init__()
        self.idx = self._new()
        self.steps = 0  # batches since the last reload
        self.model = Model(self.TTL_S)
        self.now = 1000.0
        self.base_unknown = 0  # counters are not in a snapshot: the model's count at the last load

    def _new(self) -> dict[str, Any]:
        kw = {"ttl_s": self.TTL_S, **self.KW}
        return {"native": KVIndex(**kw), "generic": KVIndex(table=BytesStoreTable(), **kw),
                "engine": EngineKeyIndex(HASHER, **kw)}

    def _apply(self, src: str, *events: Any) -> None:
        self._advance()
        self._to_indexes(src, *events)

    def _advance(self) -> None:
        """The clock moves for the next batch; the model's TTL rotates as the indexes'
        will when they get it."""
        self.steps += 1
        self.now += self.STEP_S
        self.model.tick(self.now)

    def _to_indexes(self, src: str, *events: Any) -> None:
        for idx in self.idx.values():
            idx.apply_batch(src, KVEventBatch(self.now, list(events)), self.now)

    @rule(src=st.sampled_from(SOURCES), c=st.sampled_from(CHAINS), start=st.sampled_from([0, 0, 0, 1, 2, 3]),
          n=st.integers(1, NBLOCKS), medium=st.sampled_from(["GPU", "GPU", "CPU"]), group=st.sampled_from([0, 0, 1]),
          twice=st.booleans())
    def store(self, src: str, c: _Chain, start: int, n: int, medium: str, group: int, twice: bool) -> None:
        ev = c.stored(start, min(n, NBLOCKS - start), medium, group)
        events = [ev, ev] if twice else [ev]  # twice: a recomputed copy of the same hashes
        self._apply(src, *events)
        for e in events:
            self.model.store(src, e)

    @rule(src=st.sampled_from(SOURCES), c=st.sampled_from(CHAINS), n=st.integers(1, NBLOCKS),
          group=st.sampled_from([0, 0, 1]))
    def report_mode_store(self, src: str, c: _Chain, n: int, group: int) -> None:
        """vLLM's kv_cache_report_mode="full": a request's cached prefix announced again,
        with its session id (a real store when the source does not hold it all)."""
        ev = c.stored(0, n, "GPU", group)
        ev.session_id = "session-1"
        self._advance()  # what the source holds after the TTL's rotation decides
        again = self.model.reannounced(src, ev)
        self._to_indexes(src, ev)
        if not again:
            self.model.store(src, ev)
        else:  # no copy; but it is a BlockStored: the TTL counts from it
            self.model.stale.setdefault(src, False)
            self.model.touched.update(ev.block_hashes)

    @rule(src=st.sampled_from(SOURCES), c=st.sampled_from(CHAINS), start=st.integers(0, NBLOCKS - 1),
          n=st.integers(1, NBLOCKS), medium=st.sampled_from(["GPU", "GPU", "CPU"]), group=st.sampled_from([0, 0, 1]))
    def remove(self, src: str, c: _Chain, start: int, n: int, medium: str, group: int) -> None:
        ev = BlockRemoved(c.hashes[start:start + n], medium, group)
        self._apply(src, ev)
        self.model.remove(src, ev)

    @rule(src=st.sampled_from(SOURCES), unknown=st.integers(1, 2**63))
    def remove_unknown(self, src: str, unknown: int) -> None:
        ev = BlockRemoved([unknown], "GPU", 0)
        self._apply(src, ev)
        self.model.remove(src, ev)

    @rule(src=st.sampled_from(SOURCES))
    def all_cleared(self, src: str) -> None:
        self._apply(src, AllBlocksCleared())
        self.model.stale.setdefault(src, False)
        self.model.clear(src, ("GPU",))

    @precondition(lambda self: self.model.stale)
    @rule(data=st.data(), stale=st.booleans())
    def mark_stale(self, data: Any, stale: bool) -> None:
        src = data.draw(st.sampled_from(sorted(self.model.stale)))
        for idx in self.idx.values():
            idx.mark_stale(src, stale)
        self.model.stale[src] = stale

    @precondition(lambda self: self.model.stale)
    @rule(data=st.data())
    def clear_source(self, data: Any) -> None:
        src = data.draw(st.sampled_from(sorted(self.model.stale)))
        for idx in self.idx.values():
            idx.clear_source(src)
        self.model.clear(src)
        self.model.stale[src] = False

    @precondition(lambda self: self.model.stale)
    @rule(data=st.data())
    def remove_source(self, data: Any) -> None:
        src = data.draw(st.sampled_from(sorted(self.model.stale)))
        for idx in self.idx.values():
            idx.remove_source(src)
        self.model.clear(src)
        del self.model.stale[src]

    @rule(dt=st.sampled_from([0.5, 3.0, 7.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    # A reload starts a fresh TTL generation: at most one per 10 steps, or the TTL would
    # hardly ever see a generation end.
    @precondition(lambda self: self.steps >= 10)
    @rule(per_source=st.booleans())
    def dump_and_load(self, per_source: bool) -> None:
        """Each layout through a snapshot: ``load(dump())``, or a new index built from
        one-source dumps (``load_source`` each)."""
        self.steps = 0
        if per_source:
            fresh = self._new()
            for name, idx in self.idx.items():
                for src in idx.sources:
                    fresh[name].load_source(idx.dump(src))
            self.idx = fresh
        else:
            self.idx = {
                "native": KVIndex.load(self.idx["native"].dump()),
                "generic": KVIndex.load(self.idx["generic"].dump(), table=BytesStoreTable()),
                "engine": EngineKeyIndex.load(self.idx["engine"].dump()),
            }
        self.base_unknown = self.model.unknown_removed
        if self.model.ttl_s is not None:
            self.model.gen_start = None
            self.model.touched = {k[3] for k in self.model.copies}

    @invariant()
    def agrees_with_the_model(self) -> None:
        m = self.model
        want = m.sources_state()
        d, c, e = self.idx["native"], self.idx["generic"], self.idx["engine"]
        assert d.state() == c.state(), "native and generic tables disagree"
        assert d.state()["sources"] == want
        assert e.state()["sources"] == want
        assert set(d.state()["unlinked"]) == {k[3] for k in m.copies if k[3] not in m.keyed}
        assert e.state()["unlinked"] == ()
        for idx in (d, c, e):
            assert idx.stats.unknown_removed == m.unknown_removed - self.base_unknown
        loads = {s: Load(queue=i) for i, s in enumerate(SOURCES)}
        for chain in CHAINS[::2] + CHAINS[1:2]:
            ek_lora = NAMESPACES[chain.ns][0]
            salt = NAMESPACES[chain.ns][2]
            got_d = d.match(chain.prompt, chain.lora_name, salt)
            assert _seen(got_d) == _seen(c.match(chain.prompt, chain.lora_name, salt))
            assert _seen(got_d) == m.match(chain, tokens=True)
            assert _seen(e.match(chain.prompt, ek_lora, salt)) == m.match(chain, tokens=False)
            sd = d.score(chain.prompt, chain.lora_name, salt, loads=loads)
            sc = c.score(chain.prompt, chain.lora_name, salt, loads=loads)
            assert (sd.best, sd.ranking) == (sc.best, sc.ranking)


class TTLIndexMachine(IndexMachine):
    TTL_S = 5.0
    STEP_S = 1.0  # a generation ends every few batches


# KVSTREAM_MACHINE_EXAMPLES=400 for a longer hunt (the suite runs 60 per machine).
SETTINGS = settings(max_examples=int(os.environ.get("KVSTREAM_MACHINE_EXAMPLES", 60)), stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = SETTINGS
TestTTLIndexMachine = TTLIndexMachine.TestCase
TestTTLIndexMachine.settings = SETTINGS


class BoundedIndexMachine(IndexMachine):
    """A small ``max_bytes``: eviction may drop anything (in each layout's own order), but
    an index never holds a copy the model does not, and never matches more than it."""

    KW = {"max_bytes": 6_000}

    def report_mode_store(self, src: str, c: Any, n: int, group: int) -> None:  # not a rule here
        """Not a rule of this machine: once eviction has dropped part of what a source
        holds, the index takes that source's re-announcement of it for a store (it no
        longer holds it all), where the model, which never evicts, sees a re-announcement;
        the index then counts a copy the model does not."""
        raise AssertionError("not a rule of the bounded machine")

    @invariant()
    def agrees_with_the_model(self) -> None:
        m = self.model
        for name, idx in self.idx.items():
            st_ = idx.state()["sources"]
            assert set(st_) == set(m.stale), name
            for s, v in st_.items():
                assert v["stale"] == m.stale[s]
                for medium, g, h, n in v["blocks"]:
                    assert n <= m.copies.get((s, medium, g, h), 0), (name, s, medium, g, h, n)
            assert idx.estimated_bytes() <= idx._max_bytes, name
            for chain in CHAINS[::3]:
                lora = NAMESPACES[chain.ns][0] if name == "engine" else chain.lora_name
                want = m.match(chain, tokens=False)
                for s, got in _seen(idx.match(chain.prompt, lora, NAMESPACES[chain.ns][2])).items():
                    assert got[0] <= want[s][0], (name, s)


TestBoundedIndexMachine = BoundedIndexMachine.TestCase
TestBoundedIndexMachine.settings = SETTINGS


# -- what the machines found, one rule per test (all three layouts) ----------------------

def _all(**kw: Any) -> list[Any]:
    return [KVIndex(**kw), KVIndex(table=BytesStoreTable(), **kw), EngineKeyIndex(HASHER, **kw)]


def _rows(idx: Any, src: str) -> set[tuple[str, int]]:
    return {(m, h) for m, g, h, n in idx.state()["sources"][src]["blocks"]}


def test_a_block_stored_before_its_parent_keeps_its_ttl_once_linked() -> None:
    c = CHAINS[0]
    for idx in _all(ttl_s=5.0):
        other = CHAINS[2]  # another root
        idx.apply_batch("e0", KVEventBatch(0.0, [other.stored(0, 1, "GPU", 0)]), 1000.0)  # generation starts
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(1, 1, "GPU", 0)]), 1001.0)  # parent unseen... yet
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 1, "GPU", 0)]), 1002.0)  # ...linked now
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 1, "GPU", 0)]), 1005.0)  # generation rotates
        assert ("GPU", c.hashes[1]) in _rows(idx, "e0"), idx  # stored 4 s ago, the TTL is 5 s


def test_a_cpu_offload_store_refreshes_the_ttl() -> None:
    c = CHAINS[0]
    for idx in _all(ttl_s=5.0):
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 1, "GPU", 0)]), 1000.0)
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 1, "CPU", 0)]), 1006.0)  # rotates, then stores
        idx.apply_batch("e0", KVEventBatch(0.0, [BlockRemoved([1], "GPU", 0)]), 1011.0)  # rotates again
        assert _rows(idx, "e0") == {("GPU", c.hashes[0]), ("CPU", c.hashes[0])}, idx


def test_a_child_waiting_for_an_expired_parent_links_when_the_parent_comes_back() -> None:
    c = CHAINS[0]
    idx = KVIndex(ttl_s=5.0)
    idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 2, "CPU", 0)]), 1000.0)  # unlinked: no tokens
    idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(2, 1, "GPU", 0)]), 1006.0)  # waits for block 1
    idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 2, "GPU", 0)]), 1012.0)  # 0 and 1 expired; back
    assert idx.state()["unlinked"] == ()
    assert idx.match(c.prompt)["e0"].blocks == 3


def test_a_known_block_stored_again_after_its_parent_expired_keeps_its_ttl() -> None:
    c = CHAINS[0]
    for idx in _all(ttl_s=5.0):
        def at(now: float, *events: Any) -> None:
            idx.apply_batch("e0", KVEventBatch(0.0, list(events)), now)

        at(1000.0, c.stored(0, 3, "GPU", 0))
        at(1005.0, BlockRemoved([1], "GPU", 0))  # rotates
        at(1009.0, c.stored(3, 1, "GPU", 0))  # its parent is known: linked
        at(1010.0, BlockRemoved([1], "GPU", 0))  # rotates: blocks 0-2 expire, 3 stays
        at(1010.0, c.stored(3, 1, "GPU", 0))  # block 3 again; its parent is gone
        at(1015.0, BlockRemoved([1], "GPU", 0))  # rotates
        assert ("GPU", c.hashes[3]) in _rows(idx, "e0"), idx  # stored 5 s ago: this generation


def test_a_report_mode_reannouncement_refreshes_the_ttl_without_adding_a_copy() -> None:
    c = CHAINS[0]
    for idx in _all(ttl_s=5.0):
        again = c.stored(0, 1, "GPU", 0)
        again.session_id = "session-1"  # vLLM kv_cache_report_mode="full": the prefix is still cached
        idx.apply_batch("e0", KVEventBatch(0.0, [c.stored(0, 1, "GPU", 0)]), 1000.0)
        idx.apply_batch("e0", KVEventBatch(0.0, [BlockRemoved([1], "GPU", 0)]), 1005.0)  # rotates
        idx.apply_batch("e0", KVEventBatch(0.0, [again]), 1009.0)
        idx.apply_batch("e0", KVEventBatch(0.0, [BlockRemoved([1], "GPU", 0)]), 1010.0)  # rotates
        assert idx.state()["sources"]["e0"]["blocks"] == (("GPU", 0, c.hashes[0], 1),), idx
        assert idx.stats.reannounced_blocks == 1
