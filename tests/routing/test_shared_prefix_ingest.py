"""The native ingest of blocks other sources (or the same one) stored first.

Many engines cache the same prefix (a system prompt, a shared document): a ``BlockStored``
of hashes the table knows already, under the very keys their tokens chain to. The native
core applies those runs (one more holder of each block, or one more copy of a block the
source holds already, in its copy record) rather than leaving them to the Python rules; a
re-announcement candidate and a known hash under another key stay with the Python rules.
These tests check which path each run takes, and that the result is the Python rules' own,
on the index whose every rule runs in Python (``BytesStoreTable``).
"""

from __future__ import annotations

import random

from kvstream.routing.index import KVIndex
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch
from tests.routing.generic_table import BytesStoreTable

BS = 16


class _Counting(KVIndex):
    """A native index that counts the stored events left to the Python rules."""

    __slots__ = ("python_stores",)

    def __init__(self) -> None:
        super().__init__()
        self.python_stores = 0

    def _stored(self, s, ev):  # type: ignore[no-untyped-def]
        self.python_stores += 1
        super()._stored(s, ev)


def _toks(doc: int, n: int) -> list[int]:
    rng = random.Random(doc)
    return [rng.randrange(1, 50_000) for _ in range(n * BS)]


def _doc(prefix: list[int], own: int, n: int) -> list[int]:
    return prefix + _toks(1000 + own, n)


def _hashes(tokens: list[int]) -> list[int]:
    # Stand-in engine hashes: one per block, a function of the whole prefix (as vLLM's).
    out, h = [], 17
    for i in range(0, len(tokens), BS):
        h = hash((h, tuple(tokens[i:i + BS]))) & ((1 << 63) - 1) or 1
        out.append(h)
    return out


def _stored(tokens: list[int]) -> BlockStored:
    return BlockStored(_hashes(tokens), None, tokens, BS, None, "GPU", None)


def _both() -> tuple[_Counting, KVIndex]:
    return _Counting(), KVIndex(table=BytesStoreTable())


def test_a_prefix_other_sources_stored_first_is_applied_natively_as_the_python_rules_do() -> None:
    native, python = _both()
    prefix = _toks(1, 8)
    docs = [_doc(prefix, i, 4) for i in range(6)]
    for src in ("a", "b", "c"):  # a first store from each source sets its block size in Python
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(0.0, [_stored(_toks(500 + ord(src), 1))]))
    first = native.python_stores
    for t, (src, d) in enumerate([("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 2), ("a", 3)]):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(float(t), [_stored(docs[d])]))
        assert native.state() == python.state()
        assert native.stats == python.stats
    # b's doc 1, c's doc 2 and a's doc 3 re-store the prefix each source holds already (one
    # more copy each); the others store a prefix other sources hold: all native.
    assert native.python_stores == first, "a run of known blocks went to the Python rules"
    for d in docs:
        assert native.match(d) == python.match(d)
    # Removing one holder keeps the block for the others, as the Python rules do.
    for x in (native, python):
        x.apply_batch("a", KVEventBatch(9.0, [BlockRemoved(_hashes(docs[0]), "GPU", 0)]))
    assert native.state() == python.state() and native.stats == python.stats
    assert native.match(docs[0]) == python.match(docs[0])


def test_a_prefix_the_source_holds_already_is_one_more_copy_natively() -> None:
    native, python = _both()
    prefix = _toks(2, 6)
    for x in (native, python):
        x.apply_batch("a", KVEventBatch(0.0, [_stored(_toks(9, 1))]))
    first = native.python_stores
    docs = [_doc(prefix, i, 3) for i in range(3)]
    for t, d in enumerate(docs):  # every doc stores the shared prefix again, from its root
        for x in (native, python):
            x.apply_batch("a", KVEventBatch(float(t), [_stored(d)]))
        assert native.state() == python.state()
        assert native.stats == python.stats
    assert native.python_stores == first  # docs 1 and 2 re-store a held prefix: copies, natively
    assert native.stats.stored_blocks == python.stats.stored_blocks == 1 + 3 * 9
    # The copies are taken back one removal at a time: the prefix stays until the last.
    for t, d in enumerate(docs):
        for x in (native, python):
            x.apply_batch("a", KVEventBatch(10.0 + t, [BlockRemoved(_hashes(d), "GPU", 0)]))
        assert native.state() == python.state() and native.stats == python.stats
        assert native.match(prefix) == python.match(prefix)


def test_a_removal_after_a_further_copy_in_the_same_batch_sees_the_copy() -> None:
    """One call applies a further copy and then, in the same batch, removals of it: the
    removals must see the copy record the store just wrote (one removal leaves the block
    held, the second releases it). Read once per call, the records were empty for the
    removal, which dropped the holding with one copy still counted: the stream fault
    campaign's seed 8. From decoded batches and from raw payloads alike."""
    from kvstream.wire.events import EventEncoder

    enc = EventEncoder()
    prefix = _toks(5, 5)
    docs = [_doc(prefix, i, 2) for i in range(2)]
    pre = _hashes(prefix)
    for raw in (False, True):
        native, python = _both()

        def apply(src: str, batch: KVEventBatch) -> None:
            for x in (native, python):
                if raw and x is native:
                    x.apply_payload(src, enc.encode(batch))
                else:
                    x.apply_batch(src, batch)

        apply("a", KVEventBatch(0.0, [_stored(_toks(9, 1))]))
        apply("b", KVEventBatch(0.0, [_stored(_toks(8, 1))]))
        apply("a", KVEventBatch(1.0, [_stored(docs[0])]))
        apply("b", KVEventBatch(1.0, [_stored(docs[0])]))
        first = native.python_stores
        apply("a", KVEventBatch(2.0, [_stored(docs[1]), BlockRemoved(pre, "GPU", 0), BlockStored(
            _hashes(_toks(7, 1)), None, _toks(7, 1), BS, None, "GPU", None)]))
        assert native.python_stores == first
        assert native.state() == python.state() and native.stats == python.stats
        assert native.match(prefix) == python.match(prefix)
        assert native.match(prefix)["a"].blocks == len(prefix) // BS  # one copy is left
        apply("a", KVEventBatch(3.0, [BlockRemoved(pre, "GPU", 0), _stored(docs[1])]))
        assert native.state() == python.state() and native.stats == python.stats
        assert native.match(docs[1]) == python.match(docs[1])


def test_a_known_hash_under_another_key_is_left_to_the_python_rules() -> None:
    native, python = _both()
    a = _toks(3, 4)
    b = _toks(4, 4)
    for x in (native, python):
        x.apply_batch("a", KVEventBatch(0.0, [_stored(_toks(9, 1))]))
        x.apply_batch("b", KVEventBatch(0.0, [_stored(_toks(8, 1))]))
        x.apply_batch("a", KVEventBatch(1.0, [_stored(a)]))
    before = native.python_stores
    # b announces a's hashes with other tokens: a key conflict, for the Python rules.
    ev = BlockStored(_hashes(a), None, b, BS, None, "GPU", None)
    for x in (native, python):
        x.apply_batch("b", KVEventBatch(2.0, [ev]))
    assert native.python_stores == before + 1
    assert native.state() == python.state() and native.stats == python.stats


def _other_hashes(tokens: list[int], salt: int) -> list[int]:
    # Another engine's hashes of the same tokens (another seed or hash configuration).
    return [(h * 0x9E3779B97F4A7C15 + salt) & ((1 << 63) - 1) or 1 for h in _hashes(tokens)]


def test_the_same_tokens_under_other_engines_hashes_are_family_conflicts_applied_natively() -> None:
    """Engines of one block size that store the same tokens under hashes of their own: each
    later hash is a family conflict (its block under an alias key no prompt produces). The
    native core applies those runs as the Python rules do: same state, same stats, same
    matches, the same removals and chains from an aliased parent afterwards."""
    native, python = _both()
    for src in ("a", "b", "c"):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(0.0, [_stored(_toks(500 + ord(src), 1))]))
    prefix = _toks(2, 6)
    doc = prefix + _toks(3, 3)
    first = native.python_stores
    steps: list[tuple[str, BlockStored | BlockRemoved]] = [
        ("a", _stored(doc)),
        # b: the prefix under its own hashes (conflicts), then blocks no one holds (new).
        ("b", BlockStored(_other_hashes(doc, 1)[:6] + _hashes(_toks(7, 2)), None, prefix + _toks(7, 2), BS, None,
                          "GPU", None)),
        # c: the whole doc under a third set of hashes, then a run chained from its aliased block.
        ("c", BlockStored(_other_hashes(doc, 2), None, doc, BS, None, "GPU", None)),
        ("c", BlockStored([77, 78], _other_hashes(doc, 2)[-1], _toks(9, 2), BS, None, "GPU", None)),
        ("b", BlockRemoved(_other_hashes(doc, 1)[2:4], "GPU")),
        ("a", BlockRemoved(_hashes(doc)[:2], "GPU")),
    ]
    for t, (src, ev) in enumerate(steps):
        for x in (native, python):
            x.apply_batch(src, KVEventBatch(float(t), [ev]))
        assert native.state() == python.state()
        assert native.stats == python.stats
    assert native.stats.family_conflicts == 6 + 9
    assert native.python_stores == first, "a family conflict went to the Python rules"
    for q in (doc, prefix + _toks(7, 2), doc + _toks(9, 2)):
        assert native.match(q) == python.match(q)
