"""The native table (``kvstream._native.NativeMap``, the default ``BlockTable`` and every
medium's ``key -> mask`` map): a dict's behaviour for any key and value, through churn,
bulk export and load, and shrinking; the bytes it really allocates are counted and the
count follows what it holds. ``KVIndex(table=...)`` takes it, its names, or any
``BlockTable``."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.routing.table import TABLES, NativeBlockTable

_keys = st.one_of(
    st.integers(0, 40), st.integers(0, 2**64 - 1), st.integers(1, 64).map(lambda i: i << 58),
    st.integers(-5, -1), st.integers(2**64, 2**66), st.binary(max_size=2), st.booleans(),
)
_values = st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64, 2**70), st.integers(-3, -1),
                    st.tuples(st.integers(0, 9)), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "set", "pop", "get", "del"]), _keys, _values), max_size=300))
def test_the_native_map_behaves_like_a_dict(ops) -> None:
    m, d = NativeBlockTable(), {}
    for op, k, v in ops:
        if op == "set":
            m[k] = v
            d[k] = v
        elif op == "pop":
            assert m.pop(k, None) == d.pop(k, None)
        elif op == "del":
            if k in d:
                del m[k]
                del d[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        else:
            assert (k in m) == (k in d) and m.get(k) == d.get(k) and m.get(k, 7) == d.get(k, 7)
            # The value comes back as the object stored: True stays a bool, a tuple a tuple.
            assert type(m.get(k)) is type(d.get(k))
        assert len(m) == len(d) and bool(m) == bool(d)
    assert dict(m.items()) == d and set(m) == set(d) and sorted(map(repr, m.values())) == sorted(map(repr, d.values()))
    with pytest.raises(KeyError):
        m.pop(object())
    with pytest.raises(KeyError):
        m[2**70 + 1]  # noqa: B018


def test_churn_keeps_every_entry_and_iterates_in_insertion_order() -> None:
    rnd = random.Random(5)
    m, d = NativeBlockTable(), {}
    for step in range(30_000):
        # Strided keys and sequential ones (clusters for a weak hash).
        k = rnd.randrange(1, 3000) * (1 << 44) if step % 2 else 1 + rnd.randrange(4000)
        if rnd.random() < 0.55:
            m[k] = d[k] = 2 * step + 1
        else:
            assert m.pop(k, -1) == d.pop(k, -1)
    assert dict(m.items()) == d
    fresh = NativeBlockTable()
    for k in range(1, 101):
        fresh[k] = k
    assert list(fresh) == list(range(1, 101))  # insertion order while nothing was removed


def test_a_key_iterated_while_the_map_changes_is_a_snapshot() -> None:
    m = NativeBlockTable()
    m.update({k: k for k in range(1, 11)})
    for k in m:  # deleting while iterating: a dict would raise; the walk is over a copy
        del m[k]
    assert len(m) == 0 and not m


def test_bulk_export_and_load_round_trip_and_refuse_duplicates_with_the_map_unchanged() -> None:
    src = NativeBlockTable()
    src.update([(k, 100 + k) for k in range(1, 21)] + [(b"wide", (1, 2)), (2**65, 3)])
    ks, vs, other = src.export_u64()
    assert dict(zip(ks, vs)) == {k: 100 + k for k in range(1, 21)} and other == {b"wide": (1, 2), 2**65: 3}
    again = NativeBlockTable()
    again.load_u64(ks, vs, other.items())
    assert dict(again.items()) == dict(src.items())
    before = dict(again.items())
    with pytest.raises(ValueError, match="duplicate"):
        again.load_u64(ks[:1], vs[:1])
    fresh = NativeBlockTable()
    with pytest.raises(ValueError, match="duplicate"):
        fresh.load_u64(array("Q", [5, 6, 7, 5]), array("Q", [1, 2, 3, 4]))
    assert len(fresh) == 0 and dict(fresh.items()) == {}  # a refused load into an empty map leaves it empty
    with pytest.raises(ValueError, match="key 0"):
        again.load_u64(array("Q", [0]), array("Q", [1]))
    with pytest.raises(ValueError, match="keys but"):
        again.load_u64(array("Q", [9]), array("Q", []))
    assert dict(again.items()) == before
    assert again.get_many(array("Q", [1, 999, 20])) == [101, None, 120]


def test_the_bytes_it_allocates_are_counted_and_shrink_after_deletions() -> None:
    m = NativeBlockTable()
    assert m.native_bytes() == 0
    for k in range(1, 100_001):
        m[k] = k
    big = m.native_bytes()
    # 16 bytes of column (at most an eighth spare) + 4-byte slots at 60-80 % load: the
    # two maps of a one-source index stay under 48 bytes per (block, source) entry
    assert 21 * 100_000 <= big <= 24.7 * 100_000
    for k in range(1, 99_001):
        del m[k]
    assert big <= m.native_bytes() <= big + 6 * 100_000  # removals keep the room and list the freed positions...
    m.shrink()
    assert m.native_bytes() < big // 10 and dict(m.items()) == {k: k for k in range(99_001, 100_001)}
    m[b"side"] = 1  # ...and the side dict is counted beside the native bytes
    assert m.nbytes() > m.native_bytes()


def test_the_table_is_a_constructor_choice() -> None:
    from kvstream.hashing import BlockHasher
    from kvstream.routing.index import IndexUsageError, KVIndex

    assert type(KVIndex()._table) is NativeBlockTable
    assert all(type(KVIndex(table=name)._table) is NativeBlockTable for name in TABLES)  # "dict", "compact": former names
    mine = NativeBlockTable()
    assert KVIndex(table=mine)._table is mine
    with pytest.raises(IndexUsageError, match="table must be one of"):
        KVIndex(table="arrays")
    with pytest.raises(IndexUsageError, match="lacks .*export_u64"):
        KVIndex(table={})  # a dict is not a BlockTable: no bulk operations
    full = NativeBlockTable()
    full[1] = 2
    with pytest.raises(IndexUsageError, match="empty"):
        KVIndex(table=full)
    with pytest.raises(IndexUsageError, match="engine keying stores no block table"):
        KVIndex(keying="engine", hasher=BlockHasher("xxhash", 16, seed="0"), table="native")


def test_the_native_map_takes_true_for_the_key_one_as_a_dict_does() -> None:
    # Found by the property test above: `True` went to the dict part while 1 lived in the
    # columns, so the map held two entries where a dict holds one.
    native, plain = NativeBlockTable(), {}
    for key, value in [(1, 5), (True, 7), (False, 3), (0, 4)]:
        native[key] = value
        plain[key] = value
    assert len(native) == len(plain) == 2
    assert native[1] == native[True] == 7 and native[0] == native[False] == 4
    del native[True]
    assert 1 not in native and len(native) == 1


def test_a_big_table_past_the_small_index_still_behaves_like_a_dict() -> None:
    """Past 2**17 entries the table's index changes layout (4-byte slots sized to their
    load, docs/architecture.md): the same dict behaviour through removals, re-insertion,
    bulk export and load, and shrinking, and fewer bytes per entry than the small layout."""
    m, d = NativeBlockTable(), {}
    n = 200_000
    for k in range(1, n + 1):
        m[k * 7919] = k
        d[k * 7919] = k
    assert m.native_bytes() <= 25.3 * n  # 16-18 bytes of column + 5.3-7.3 of slots
    for k in range(1, n + 1, 3):
        del m[k * 7919]
        del d[k * 7919]
    for k in range(1, 5000):
        m[k * 7919] = -1 if k % 2 else k  # -1 goes to the side dict, the rest re-inserted
        d[k * 7919] = -1 if k % 2 else k
    assert len(m) == len(d) and dict(m.items()) == d
    assert all(m.get(k) == v for k, v in list(d.items())[::101]) and m.get(7) is None
    ks, vs, side = m.export_u64()
    again = NativeBlockTable()
    again.load_u64(ks, vs, side.items())
    assert dict(again.items()) == d
    for k in list(d)[: len(d) - 10]:
        del m[k]
    m.shrink()
    assert dict(m.items()) == dict(list(d.items())[-10:]) and m.native_bytes() < 10_000
