"""The native block hasher against its specification: vLLM's naive loop.

The oracle is the definition itself, ``serialize((parent, tuple(block), extra_keys))`` then
digest, with ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` or
``cbor2.dumps(obj, canonical=True)`` and ``hashlib.sha256`` or ``xxhash.xxh3_128_digest``.
Every test here calls the native core (``kvstream._native.hash_chain``) directly as well as
through ``BlockHasher``, so a change that quietly sends everything to the Python path fails
them: inputs the core takes must come back from the core, inputs it does not take must come
back as None and then hash (or fail) exactly as the oracle does.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
from pathlib import Path
from typing import Any, Callable

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream import _native
from kvstream.hashing import BlockHasher, HashingError, RequestBlockHasher, hash_function

CODES = {"sha256": 0, "sha256_cbor": 1, "xxhash": 2, "xxhash_cbor": 3, "native": 4}
VLLM = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def oracle(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's hash function, written out: serializer, then digest."""
    if algorithm.endswith("_cbor"):
        ser: Callable[[Any], bytes] = lambda o: cbor2.dumps(o, canonical=True)  # noqa: E731
    else:
        ser = lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
    if algorithm.startswith("sha256"):
        return lambda o: hashlib.sha256(ser(o)).digest()
    return lambda o: xxhash.xxh3_128_digest(ser(o))


def naive_chain(algorithm: str, parent: bytes, tokens: Any, block_size: int, extras: Any = None) -> list[bytes]:
    fn, prev, out = oracle(algorithm), parent, []
    for i in range(len(tokens) // block_size):
        ek = None if extras is None else extras[i]
        prev = fn((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), ek))
        out.append(prev)
    return out


def native(algorithm: str, parent: bytes, tokens: Any, block_size: int, extras: Any = None) -> list[bytes] | None:
    return _native.hash_chain(CODES[algorithm], block_size, parent, tokens, len(tokens) // block_size, extras)


# Ids of every pickle and CBOR width class and the boundaries between them.
edge_ints = st.sampled_from([
    0, 1, 23, 24, 255, 256, 65535, 65536, 2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
    2**64 - 1, 2**64, -1, -24, -25, -256, -257, -(2**31), -(2**31) - 1, -(2**63), -(2**63) - 1,
    -(2**64), -(2**64) - 1, -128, -129, -(2**15), -(2**15) - 1, 2**71, -(2**71), 10**40, -(10**40),
])
ids = st.one_of(
    st.integers(min_value=0, max_value=150_000),
    st.integers(min_value=-(2**70), max_value=2**70),
    edge_ints,
)
text = st.one_of(st.text(max_size=8), st.text(min_size=250, max_size=300), st.sampled_from(["", "é", "日本", "😀"]))
blob = st.one_of(st.binary(max_size=8), st.binary(min_size=250, max_size=300))
leaf = st.one_of(st.none(), st.booleans(), ids, text, blob)
tree = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.lists(c, max_size=4).map(tuple), max_leaves=10)
extra_key = st.lists(tree, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(
    algorithm=st.sampled_from(VLLM),
    block_size=st.integers(min_value=1, max_value=20),
    data=st.data(),
)
def test_the_native_chain_equals_the_naive_loop_on_random_and_edge_input(algorithm, block_size, data):
    tokens = data.draw(st.lists(ids | st.booleans(), max_size=block_size * 5))
    n = len(tokens) // block_size
    extras = data.draw(st.none() | st.lists(st.none() | extra_key, min_size=n, max_size=n))
    parent = data.draw(st.binary(min_size=1, max_size=300))
    container = data.draw(st.sampled_from([list, tuple]))
    want = naive_chain(algorithm, parent, tokens, block_size, extras)
    got = native(algorithm, parent, container(tokens), block_size, extras)
    assert got == want  # never None: every value here is one the core encodes itself
    assert BlockHasher(algorithm, block_size, seed="p").hash_blocks(container(tokens), parent, extras) == want


@settings(max_examples=150, deadline=None)
@given(algorithm=st.sampled_from(VLLM), data=st.data())
def test_a_prompt_of_realistic_length_equals_the_naive_loop(algorithm, data):
    block_size = data.draw(st.sampled_from([16, 32]))
    tokens = data.draw(st.lists(st.integers(min_value=0, max_value=200_000), min_size=block_size * 8, max_size=block_size * 40))
    h = BlockHasher(algorithm, block_size, seed="x")
    want = naive_chain(algorithm, h.root, tokens, block_size)
    assert native(algorithm, h.root, tokens, block_size) == want
    assert RequestBlockHasher(h).extend(tokens) == want


def test_pickle_memo_references_are_kept_for_shared_objects():
    # pickle memoizes by identity: one str object used twice is written once, then BINGET;
    # an extra key that *is* the parent object refers back to it. Equal but distinct
    # objects are written twice. The core must reproduce all three.
    parent = bytes(range(32))
    s = "mm-" + "x" * 3  # built at run time: not interned with any literal
    inner = ("mm", s, 0)
    cases = [
        ((s, s),),
        (inner, inner, ("mm", s, 4)),
        (parent, ("prompt_embeds", parent)),
        (("mm-xxx", "mm-" + "xxx"),),
        tuple((f"id{i % 3}", s) for i in range(300)),  # > 256 memo entries: LONG_BINGET
    ]
    tokens = list(range(16))
    for algorithm in ("sha256", "xxhash"):
        for extra in cases:
            want = naive_chain(algorithm, parent, tokens, 16, [extra])
            assert native(algorithm, parent, tokens, 16, [extra]) == want, extra


def test_lists_in_extra_keys_are_appended_in_batches_of_1000():
    tokens = list(range(4))
    for extra in ([], [7], list(range(999)), list(range(1000)), list(range(1001)), list(range(2500))):
        for algorithm in VLLM:
            want = naive_chain(algorithm, b"p", tokens, 4, [(extra,)])
            assert native(algorithm, b"p", tokens, 4, [(extra,)]) == want, (algorithm, len(extra))


def test_ints_of_every_size_in_tokens_and_extra_keys():
    big = [2**64, -(2**64) - 1, 2**2040, 2**2048 + 12345, -(2**3000), 10**700]
    for algorithm in VLLM:
        tokens = [1, *big, 2]
        want = naive_chain(algorithm, b"r", tokens, 4)
        assert native(algorithm, b"r", tokens, 4) == want
        assert native(algorithm, b"r", [5], 1, [tuple(big)]) == naive_chain(algorithm, b"r", [5], 1, [tuple(big)])


def test_floats_are_encoded_for_pickle_and_handed_back_for_cbor():
    extra = [(1.5, -0.0, float("inf"), 1e300)]
    for algorithm in ("sha256", "xxhash"):
        assert native(algorithm, b"p", [1, 2], 2, extra) == naive_chain(algorithm, b"p", [1, 2], 2, extra)
    for algorithm in ("sha256_cbor", "xxhash_cbor"):
        assert native(algorithm, b"p", [1, 2], 2, extra) is None
        assert BlockHasher(algorithm, 2, seed="0").hash_blocks([1, 2], b"p", extra) == naive_chain(algorithm, b"p", [1, 2], 2, extra)


class _Tok(int):
    """An int subclass: pickle writes it through its reduce, the core hands it back."""


@pytest.mark.parametrize("algorithm", VLLM)
def test_inputs_the_core_does_not_encode_come_back_and_hash_like_the_oracle(algorithm):
    lone = "\udcff"  # a lone surrogate: pickle writes it with surrogatepass
    cases: list[tuple[bytes, list[Any], Any]] = [
        (b"p", [1, _Tok(2)], None),
        (b"p", [1, 2], [(lone,)]),
        (b"p", [1, 2], [(frozenset({1}),)]),
        (b"p" * 70_000, [1, 2], None),  # a pickle frame past 64 KiB: the C pickler splits it
    ]
    for parent, tokens, extras in cases:
        got = native(algorithm, parent, tokens, 2, extras)
        if not (algorithm.endswith("_cbor") and parent == b"p" * 70_000):
            assert got is None, (parent[:4], tokens, extras)
        try:
            want: Any = naive_chain(algorithm, parent, tokens, 2, extras)
        except Exception as exc:  # the oracle's own refusal (e.g. cbor2 and a lone surrogate)
            with pytest.raises(type(exc)):
                BlockHasher(algorithm, 2, seed="0").hash_blocks(tokens, parent, extras)
            continue
        assert BlockHasher(algorithm, 2, seed="0").hash_blocks(tokens, parent, extras) == want


@pytest.mark.parametrize("algorithm", [*VLLM, "native"])
def test_numpy_ids_hash_as_python_does_them_or_fail_as_it_does(algorithm):
    np = pytest.importorskip("numpy")
    h = BlockHasher(algorithm, 4, seed="0")
    ids = np.arange(8, dtype=np.int64)
    as_list = list(ids)  # numpy scalars, not ints
    if algorithm == "native":
        # array('I') takes numpy ints through __index__: the same digests as plain ints.
        assert h.hash_blocks(as_list) == h.hash_blocks(list(range(8))) == h.hash_blocks(ids)
        return
    assert native(algorithm, h.root, as_list, 4) is None
    try:
        want: Any = naive_chain(algorithm, h.root, as_list, 4)
    except Exception as exc:
        with pytest.raises(type(exc)):
            h.hash_blocks(as_list)
    else:
        assert h.hash_blocks(as_list) == want
    assert h.hash_blocks(ids.tolist()) == naive_chain(algorithm, h.root, list(range(8)), 4)


@pytest.mark.parametrize("bad", [1.5, "7", None, b"7", 2**32, -1])
def test_native_mode_refuses_ids_it_cannot_pack_with_a_hashing_error(bad):
    h = BlockHasher("native", 2, seed="0")
    assert native("native", h.root, [1, bad], 2) is None
    with pytest.raises(HashingError):
        h.hash_blocks([1, bad])


def test_bad_calls_into_the_core_are_typed_local_errors_not_crashes():
    with pytest.raises(_native.NativeLocalError, match="algorithm code 9"):
        _native.hash_chain(9, 16, b"r", [1] * 16, 1)
    with pytest.raises(_native.NativeLocalError, match="block_size"):
        _native.hash_chain(0, 0, b"r", [1] * 16, 1)
    with pytest.raises(_native.NativeLocalError, match="holds 15"):
        _native.hash_chain(0, 16, b"r", [1] * 15, 1)
    with pytest.raises(_native.NativeLocalError, match="overflow"):
        _native.hash_chain(0, 2**62, b"r", [1], 2**62)
    with pytest.raises(_native.NativeLocalError, match="2 entries for 1 blocks"):
        _native.hash_chain(1, 2, b"r", [1, 2], 1, [None, None])
    with pytest.raises(TypeError):
        _native.hash_chain(0, 16, "not bytes", [1] * 16, 1)  # type: ignore[arg-type]
    assert issubclass(_native.NativeLocalError, ValueError)
    assert _native.hash_chain(0, 16, b"r", {1: 2}, 0) is None  # type: ignore[arg-type]  # not a list: Python's path


def test_the_core_reproduces_the_golden_vectors(golden_dir: Path):
    doc = json.loads((golden_dir / "vllm-0.33.0" / "stream.json").read_text())
    vec = doc["hash"]["vectors"]
    root = hash_function("sha256_cbor")(doc["hash"]["none_hash_seed"])
    d0, d1 = _native.hash_chain(1, 16, root, list(range(1, 33)), 2)
    assert d0.hex() == vec["tokens_1_16_block0"]["hex"]
    assert d1.hex() == vec["tokens_17_32_block1"]["hex"]
    (salted,) = _native.hash_chain(1, 16, root, list(range(1, 17)), 1, [(("cache_salt", "s"),)])
    assert salted.hex() == vec["tokens_1_16_salt_s"]["hex"]
    for rid, rec in doc["requests"].items():
        assert rec["block_hashes_hex"], rid


def test_long_prompts_hashed_in_threads_at_once_equal_the_naive_loop():
    # Long chains release the GIL: threads hashing at the same time must each get their
    # own prompt's digests.
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(150_000) for _ in range(8192)] for _ in range(6)]
    results: dict[tuple[str, int], list[bytes]] = {}

    def work(algorithm: str, i: int) -> None:
        h = BlockHasher(algorithm, 16, seed="t")
        for _ in range(3):
            results[(algorithm, i)] = h.hash_blocks(prompts[i])

    threads = [threading.Thread(target=work, args=(a, i)) for a in VLLM for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for (algorithm, i), got in results.items():
        assert got == naive_chain(algorithm, BlockHasher(algorithm, 16, seed="t").root, prompts[i], 16)
    assert len(results) == len(threads)


@pytest.mark.parametrize("algorithm", VLLM)
def test_float_and_str_token_ids_hash_as_the_serializer_writes_them(algorithm):
    # Not token ids any engine sends, but vLLM would hash them: the same digests either way.
    for tokens in ([1, 2.5, 3, 4], [1, "a", 3, b"b"], [None, 2, 3, (4, 5)]):
        want = naive_chain(algorithm, b"p", tokens, 2)
        assert BlockHasher(algorithm, 2, seed="0").hash_blocks(tokens, b"p") == want
        assert RequestBlockHasher(BlockHasher(algorithm, 2, seed="0", root=b"p")).extend(tokens) == want


anything = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(),
        st.builds(_Tok, st.integers(min_value=-5, max_value=5)),
    ),
    lambda c: st.lists(c, max_size=3) | st.lists(c, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=3), c, max_size=2) | st.frozensets(st.integers(), max_size=2),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(algorithm=st.sampled_from(VLLM), data=st.data())
def test_arbitrary_values_hash_like_the_oracle_or_fail_like_it(algorithm, data):
    # Whatever a caller (or a decoded remote event) puts in the tokens or the extra keys:
    # the native core encodes it exactly or hands it back; never a different digest, never
    # a different kind of failure, never a crash.
    tokens = data.draw(st.lists(anything, min_size=2, max_size=6))
    extras = data.draw(st.none() | st.lists(st.none() | st.lists(anything, max_size=3).map(tuple), min_size=len(tokens) // 2, max_size=len(tokens) // 2))
    h = BlockHasher(algorithm, 2, seed="0")
    try:
        want: Any = naive_chain(algorithm, h.root, tokens, 2, extras)
    except Exception as exc:
        with pytest.raises(type(exc)):
            h.hash_blocks(tokens, None, extras)
        return
    assert h.hash_blocks(tokens, None, extras) == want


def test_deeply_nested_extra_keys_are_handed_back_not_recursed_into():
    deep: Any = ("leaf",)
    for _ in range(200):
        deep = (deep,)
    for algorithm in VLLM:
        assert native(algorithm, b"p", [1, 2], 2, [deep]) is None
        assert BlockHasher(algorithm, 2, seed="0").hash_blocks([1, 2], b"p", [deep]) == naive_chain(algorithm, b"p", [1, 2], 2, [deep])
