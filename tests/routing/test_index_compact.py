"""``KVIndex(compact=True)``: the same specification as the dict layout, and its map.

Every rule test, the golden-capture test and the allocator property test are re-run here
with ``compact=True`` as the default, so both layouts answer to one specification.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.routing._compactmap import U64Map
from kvstream.routing.index import KVIndex

from tests.routing.test_index import *  # noqa: F401,F403  (re-run every rule test in compact mode)
from tests.routing.test_index_golden import *  # noqa: F401,F403
from tests.routing.test_index_property import *  # noqa: F401,F403


@pytest.fixture(autouse=True)
def _compact_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KVIndex.__init__.__kwdefaults__, "compact", True)


def test_the_fixture_really_builds_compact_indexes() -> None:
    idx = KVIndex()
    assert isinstance(idx._young, U64Map) and isinstance(idx._held[0], U64Map)


_keys = st.one_of(
    st.integers(0, 40), st.integers(0, 2**64 - 1), st.integers(2**64, 2**66), st.binary(max_size=2)
)
_values = st.one_of(st.integers(0, 2**64 - 1), st.integers(2**64, 2**70), st.tuples(st.integers(0, 9)))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("set pop get"), _keys, _values), max_size=300))
def test_u64map_behaves_like_an_insertion_ordered_dict(ops) -> None:
    m, d = U64Map(), {}
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
    # Keys the arrays can hold keep insertion order (what eviction relies on).
    arr = [k for k in d if type(k) is int and 0 < k < 2**64 and type(d[k]) is int and d[k] < 2**64]
    assert [k for k in m if k in set(arr)] == arr


def test_u64map_survives_churn_and_regrowth() -> None:
    rnd = random.Random(5)
    m, d = U64Map(), {}
    for step in range(20_000):
        k = rnd.randrange(1, 3000) * (1 << 44)  # strided keys: the mix must spread them
        if rnd.random() < 0.55:
            m[k] = d[k] = 2 * step + 1  # odd: bit 0 keeps the walk going
        else:
            assert m.pop(k, -1) == d.pop(k, -1)
    assert dict(m.items()) == d
    assert m.walk([*list(d)[:50], 7, 9], 1) == [*list(d.values())[:50], 0]
