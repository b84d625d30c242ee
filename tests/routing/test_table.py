"""The block tables. ``ArrayBlockTable`` (the compact in-memory ``BlockTable``): a dict's
behaviour over arrays, through churn, crafted collisions and regrowth; deletion shifts
clusters back and never leaves the index full. ``DictBlockTable`` (the default): bulk export
and load like the compact one, shrinking. ``KVIndex(table=...)`` picks either, or takes
any ``BlockTable``."""

from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from array import array

from kvstream.routing.table import _EMPTY, ArrayBlockTable, DictBlockTable

_keys = st.one_of(
    st.integers(0, 40), st.integers(0, 2**64 - 1), st.integers(1, 64).map(lambda i: i << 58),
    st.integers(2**64, 2**66), st.binary(max_size=2),
)
_values = st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64, 2**70), st.tuples(st.integers(0, 9)))


def _consistent(m: ArrayBlockTable) -> None:
    """Every live array entry is found from its home slot, and the index holds nothing else."""
    live = [k for k in m.ks if k]
    assert len(live) == m.n == m.used
    assert sum(1 for j in m.idx if j != _EMPTY) == m.n
    for k in live:
        assert k in m


@pytest.mark.parametrize("nursery", [0, 5])
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "set", "pop", "get"]), _keys, _values), max_size=300))
def test_u64map_behaves_like_a_dict(nursery, ops) -> None:
    m, d = ArrayBlockTable(nursery), {}
    for op, k, v in ops:
        if op == "set":
            m[k] = v
            d[k] = v
        elif op == "pop":
            assert m.pop(k, None) == d.pop(k, None)
        else:
            assert (k in m) == (k in d) and m.get(k) == d.get(k)
        assert len(m) == len(d) and bool(m) == bool(d)
    assert dict(m.items()) == d and set(m) == set(d)
    _consistent(m)


def test_u64map_survives_churn_crafted_keys_and_regrowth() -> None:
    rnd = random.Random(5)
    m, d = ArrayBlockTable(nursery=0), {}
    for step in range(20_000):
        # Strided keys (the multiply must spread them) and sequential ones (clusters).
        k = rnd.randrange(1, 3000) * (1 << 44) if step % 2 else 1 + rnd.randrange(4000)
        if rnd.random() < 0.55:
            m[k] = d[k] = 2 * step + 1  # odd: bit 0 keeps the walk going
        else:
            assert m.pop(k, -1) == d.pop(k, -1)
    assert dict(m.items()) == d
    _consistent(m)
    assert m.walk([*list(d)[:50], 7 << 60], 1) == [*(d[k] for k in list(d)[:50]), 0]


def test_churn_at_a_steady_size_reuses_positions_and_never_rebuilds() -> None:
    m = ArrayBlockTable(nursery=0)
    for k in range(1, 5001):
        m[k * 0x9E37] = k
    idx_before = len(m.idx)
    for k in range(5001, 50_001):  # FIFO churn: one in, one out
        m[k * 0x9E37] = k
        del m[(k - 5000) * 0x9E37]
    assert len(m) == 5000 and len(m.idx) == idx_before and len(m.ks) <= 5001
    _consistent(m)


def test_the_nursery_moves_its_oldest_entries_to_the_arrays_and_bulk_export_sees_both() -> None:
    m = ArrayBlockTable(nursery=8)
    for k in range(1, 21):
        m[k] = 100 + k
    assert len(m.young) <= 8 and m.n == 20 - len(m.young)
    assert list(m) == list(range(1, 21))  # oldest first: the arrays, then the nursery
    ks, vs, other = m.export_u64()
    assert dict(zip(ks, vs)) == {k: 100 + k for k in range(1, 21)} and other == {}
    again = ArrayBlockTable()
    again.load_u64(ks, vs)
    assert dict(again.items()) == dict(m.items())
    with pytest.raises(ValueError, match="duplicate"):
        again.load_u64(ks[:1], vs[:1])
    assert len(again) == 20


def test_new_entries_skip_the_nursery_while_the_arrays_hold_many_and_use_it_again_after() -> None:
    m, d = ArrayBlockTable(nursery=8), {}
    for k in range(1, 41):
        m[k * 0x9E37] = d[k * 0x9E37] = k
        m.tune()
    assert m.direct and not m.young and m.n == 40  # straight to the arrays
    assert list(m) == list(d)  # the nursery settled first: still oldest first
    for k in range(1, 36):
        assert m.pop(k * 0x9E37) == d.pop(k * 0x9E37)
    assert not m.direct  # fewer than 8 left in the arrays
    m[99] = d[99] = 7
    assert m.young == {99: 7} and dict(m.items()) == d
    _consistent(m)


def test_settling_in_bulk_sends_crowded_and_out_of_range_entries_to_the_dict_beside() -> None:
    m = ArrayBlockTable(nursery=0)
    m.young.update({k << 40: k for k in range(1, 200)})  # entries as the nursery holds them
    m.young[2**64 + 5] = 1  # not a u64 key: the entry-by-entry settle
    m.settle(len(m.young))
    assert not m.young and dict(m.items()) == {**{k << 40: k for k in range(1, 200)}, 2**64 + 5: 1}
    crowd = ArrayBlockTable(nursery=0)
    crowd.reserve(64)
    h = lambda k: ((k * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> crowd.shift  # noqa: E731
    same = [k for k in range(1, 200_000) if h(k) == h(1)][:40]  # one home slot, 40 keys
    crowd.young.update({k: k for k in same})
    crowd.settle(40)
    assert dict(crowd.items()) == {k: k for k in same} and crowd.other  # past 24 slots: the dict
    _consistent(crowd)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(_keys, _values), max_size=60), st.lists(st.tuples(_keys, _values), max_size=20))
def test_the_dict_table_exports_and_loads_in_bulk_like_the_compact_one(items, more) -> None:
    src = DictBlockTable(items)
    ks, vs, other = src.export_u64()
    assert {**dict(zip(ks, vs)), **other} == dict(src) and 0 not in ks
    for table in (DictBlockTable(), ArrayBlockTable()):
        table.load_u64(ks, vs, other.items())
        assert dict(table.items()) == dict(src)
        dup = [k for k in ks[:1]]
        if dup:  # a key listed again is refused, and the table is unchanged
            with pytest.raises(ValueError):
                table.load_u64(array("Q", dup), array("Q", [1]))
            assert dict(table.items()) == dict(src)
    d = DictBlockTable(more)
    for k, _ in more[::2]:
        d.pop(k, None)
    kept = dict(d)
    d.shrink()
    assert dict(d) == kept


def test_the_dict_table_shrinks_after_deletions() -> None:
    d = DictBlockTable((k, k) for k in range(1, 100_001))
    for k in range(1, 99_001):
        del d[k]
    big = d.nbytes()
    d.shrink()
    assert d.nbytes() < big // 10 and dict(d) == {k: k for k in range(99_001, 100_001)}


def test_the_table_is_a_constructor_choice() -> None:
    from kvstream.routing.index import IndexUsageError, KVIndex
    from kvstream.hashing import BlockHasher

    assert type(KVIndex()._table) is DictBlockTable
    assert type(KVIndex(table="compact")._table) is ArrayBlockTable
    mine = DictBlockTable()
    assert KVIndex(table=mine)._table is mine
    with pytest.raises(IndexUsageError, match="table must be one of"):
        KVIndex(table="arrays")
    with pytest.raises(IndexUsageError, match="lacks .*export_u64"):
        KVIndex(table={})  # a dict is not a BlockTable: no bulk operations
    with pytest.raises(IndexUsageError, match="empty"):
        KVIndex(table=DictBlockTable({1: 2}))
    with pytest.raises(IndexUsageError, match="engine keying stores no block table"):
        KVIndex(keying="engine", hasher=BlockHasher("xxhash", 16, seed="0"), table="compact")
