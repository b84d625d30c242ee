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
