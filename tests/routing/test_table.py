"""The block table (``ArrayBlockTable``, the in-memory ``BlockTable``): a dict's behaviour over arrays, through churn, crafted
collisions and regrowth; deletion shifts clusters back and never leaves the index full."""

from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.routing.table import _EMPTY, ArrayBlockTable

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
