"""Router keys: the chained definition from the module's text, the same keys from a list
or from an already packed ``array('I')``, and clear errors for ids that cannot be packed."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash

from kvstream.routing.keys import KEY_MASK, RouterKeyError, chain_keys, namespace, pack_tokens, prompt_keys


def _spec_keys(tokens: list[int], R: int) -> list[int]:
    # key[-1] = namespace(); key[i] = xxh3_64(uint32-LE tokens of block i, seed=key[i-1]) & KEY_MASK
    k, out = namespace(), []
    for i in range(len(tokens) // R):
        k = xxhash.xxh3_64_intdigest(struct.pack(f"<{R}I", *tokens[i * R:(i + 1) * R]), k) & KEY_MASK
        out.append(k)
    return out


def test_keys_follow_the_chained_definition_from_a_list_or_a_packed_array() -> None:
    tokens = [(i * 7919) % 150_000 for i in range(16 * 5 + 3)]
    want = _spec_keys(tokens, 16)
    assert prompt_keys(tokens, 16) == want
    assert prompt_keys(array("I", tokens), 16) == want  # a partial tail is ignored either way
    assert pack_tokens(array("I", tokens)) == pack_tokens(tokens) == struct.pack(f"<{len(tokens)}I", *tokens)
    assert chain_keys(pack_tokens(tokens), 5, 16, namespace()) == want
    assert chain_keys(pack_tokens(tokens), 0, 16, namespace()) == []


@pytest.mark.parametrize("bad, says", [([1, 1 << 32], "outside \\[0, 2\\*\\*32\\)"), ([1, -1], "outside"),
                                       ([1, "2"], "must be ints")])
def test_ids_that_are_not_uint32_are_refused_with_the_reason(bad: list, says: str) -> None:
    with pytest.raises(RouterKeyError, match=says):
        pack_tokens(bad)


# ---------------------------------------------------------------------------------------
# The native loop against the definition: random prompts, block sizes and extras.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstream import _native  # noqa: E402
from kvstream.routing.keys import mm_extras  # noqa: E402


def _spec_chain(raw: bytes, n: int, R: int, seed: int, extras: list | None) -> list[int]:
    k, out = seed, []
    for i in range(n):
        data = raw[i * 4 * R : (i + 1) * 4 * R]
        if extras is not None and extras[i]:
            data += extras[i]
        k = xxhash.xxh3_64_intdigest(data, k) & KEY_MASK
        out.append(k)
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300),
    R=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=KEY_MASK),
    data=st.data(),
)
def test_native_keys_equal_the_definition_with_and_without_extras(tokens, R, seed, data):
    n = len(tokens) // R
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    extras = data.draw(st.none() | st.lists(st.none() | st.binary(max_size=20), min_size=n, max_size=n))
    want = _spec_chain(raw, n, R, seed, extras)
    assert chain_keys(raw, n, R, seed, extras) == want
    assert _native.router_prompt_keys(tokens, R, seed, extras) == want
    assert _native.router_prompt_keys(tuple(tokens), R, seed, extras) == want
    assert pack_tokens(tokens) == pack_tokens(tuple(tokens)) == raw
    assert all(0 <= k <= KEY_MASK for k in want)


def test_prompt_keys_with_mm_items_from_a_list_an_array_or_a_tuple_agree():
    tokens = [(i * 31) % 90_000 for i in range(16 * 6 + 5)]
    items = [("img", 20), ("img2", 50)]
    want = _spec_chain(struct.pack(f"<{len(tokens)}I", *tokens), 6, 16, namespace("a", "s"), mm_extras(6, 16, items))
    for form in (list, tuple, lambda t: array("I", t)):
        assert prompt_keys(form(tokens), 16, "a", "s", items) == want


def test_ids_that_are_not_plain_ints_take_the_array_path_or_are_refused():
    # bools and numpy ints are ints to array('I'); the native packer hands them back.
    assert _native.router_pack_tokens([1, True]) is None
    assert pack_tokens([1, True]) == struct.pack("<2I", 1, 1)
    assert prompt_keys([1, True] * 8, 16) == prompt_keys([1, 1] * 8, 16)
    np = pytest.importorskip("numpy")
    ids = list(np.arange(32, dtype=np.int64))
    assert prompt_keys(ids, 16) == prompt_keys(list(range(32)), 16)
    with pytest.raises(RouterKeyError, match="outside"):
        prompt_keys([5] * 15 + [2**32], 16)
    with pytest.raises(RouterKeyError, match="must be ints"):
        prompt_keys([5] * 15 + [1.5], 16)


def test_a_chain_longer_than_its_packed_tokens_is_a_router_key_error():
    with pytest.raises(RouterKeyError, match="need 32"):
        chain_keys(pack_tokens(list(range(20))), 2, 16, namespace())
    with pytest.raises(RouterKeyError, match="one per block"):
        chain_keys(pack_tokens(list(range(32))), 2, 16, namespace(), [None])
    with pytest.raises(RouterKeyError, match="> 0"):
        chain_keys(b"", 0, 0, namespace())
    with pytest.raises(RouterKeyError, match="bytes or None"):
        chain_keys(pack_tokens(list(range(16))), 1, 16, namespace(), ["x"])  # type: ignore[list-item]
    assert chain_keys(bytearray(pack_tokens(list(range(16)))), 1, 16, 0) == chain_keys(pack_tokens(list(range(16))), 1, 16, 0)
