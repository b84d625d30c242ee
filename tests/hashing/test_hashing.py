"""kvstream.hashing: vLLM's block hashes, seed rules, extra keys, fast path and native mode."""

from __future__ import annotations

import hashlib
from array import array
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.compat import VLLM_0_11, VLLM_0_33
from kvstream.hashing import (
    ALGORITHMS,
    BlockHasher,
    HashingError,
    LoRA,
    MMItem,
    RequestBlockHasher,
    RequestExtraKeys,
    hash_function,
    none_hash,
    to_external,
    to_external_list,
)

MM_ID = hashlib.sha256(b"kvstream-golden-image-1").hexdigest()
T1_16 = list(range(1, 17))
T17_32 = list(range(17, 33))
NONE_HASH_DEFAULT = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
NONE_HASH_SEED0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def cbor_sha256(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def u64(d: bytes) -> int:
    return int.from_bytes(d, "big") & ((1 << 64) - 1)


# ---------------------------------------------------------------------------------------
# Test vectors from tests/data/golden/vllm-0.33.0/README.md (both seeds).

VECTORS_033 = {
    # name: (extra_keys, int64 with seed "vllm-none-hash", int64 with seed "0")
    "salt": ((("cache_salt", "s"),), 1501187271825542675, 3061353682369478559),
    "lora": ((("lora", "adapter-a", "/adapters/adapter-a"),), 13451244170158845619, 10777922742919616379),
    "mm": ((("mm", MM_ID, 4),), 14726551443309926482, 10678640382306463830),
}


@pytest.mark.parametrize(
    "seed, root_hex, b0, b1, a0",
    [
        ("vllm-none-hash", NONE_HASH_DEFAULT, 8866452693264111234, 807986237951177663, 3753563854825738204),
        ("0", NONE_HASH_SEED0, 3236607068019569386, 2758186210834249151, 17507053300047258101),
    ],
)
def test_readme_vectors_plain_and_chained_for_both_seeds(seed, root_hex, b0, b1, a0):
    h = BlockHasher("sha256_cbor", 16, seed=seed)
    assert h.root.hex() == root_hex
    d0 = h.hash_block(None, T1_16)
    d1 = h.hash_block(d0, T17_32)
    assert to_external(d0) == b0
    assert to_external(d1) == b1
    assert h.hash_blocks(T1_16 + T17_32 + [99]) == [d0, d1]
    assert to_external(h.hash_block(None, list(range(1000, 1016)))) == a0


@pytest.mark.parametrize("name", sorted(VECTORS_033))
@pytest.mark.parametrize("seed, col", [("vllm-none-hash", 1), ("0", 2)])
def test_readme_vectors_salt_lora_mm_for_both_seeds(name, seed, col):
    h = BlockHasher("sha256_cbor", 16, seed=seed)
    extra = VECTORS_033[name][0]
    assert to_external(h.hash_block(None, T1_16, extra)) == VECTORS_033[name][col]


def test_stream_json_vectors_have_the_full_digests(golden_dir: Path):
    doc = json.loads((golden_dir / "vllm-0.33.0" / "stream.json").read_text())
    vec = doc["hash"]["vectors"]
    h = BlockHasher("sha256_cbor", 16, seed=doc["hash"]["none_hash_seed"])
    assert h.root.hex() == doc["hash"]["NONE_HASH_hex"]
    d0 = h.hash_block(None, T1_16)
    got = {
        "tokens_1_16_block0": d0,
        "tokens_17_32_block1": h.hash_block(d0, T17_32),
        "tokens_1_16_salt_s": h.hash_block(None, T1_16, VECTORS_033["salt"][0]),
        "tokens_1_16_lora_adapter-a": h.hash_block(None, T1_16, VECTORS_033["lora"][0]),
        "tokens_1_16_mm_offset4": h.hash_block(None, T1_16, VECTORS_033["mm"][0]),
    }
    for name, digest in got.items():
        assert digest.hex() == vec[name]["hex"], name
        assert to_external(digest) == vec[name]["int64"], name


def test_request_extra_keys_build_the_readme_vector_inputs():
    lora = LoRA("adapter-a", "/adapters/adapter-a", 1)
    assert RequestExtraKeys(lora=lora).for_block(0, 16).hash_input == VECTORS_033["lora"][0]
    assert RequestExtraKeys(cache_salt="s").for_block(0, 16).hash_input == VECTORS_033["salt"][0]
    mm = RequestExtraKeys(mm_items=(MMItem(MM_ID, 4, 20),))
    assert mm.for_block(0, 16) == ((("mm", MM_ID, 4),), [[MM_ID, 4]])
    assert mm.for_block(16, 32) == ((("mm", MM_ID, -12),), [[MM_ID, -12]])
    assert mm.for_block(32, 48) == (None, None)


# ---------------------------------------------------------------------------------------
# Every block hash recorded in the golden captures.


def _replay_requests(workload: dict, hasher: BlockHasher) -> dict[str, tuple[list[int], RequestBlockHasher]]:
    """Feed each request's prompt, then its decode tokens, as vLLM's Request does."""
    reqs: dict[str, tuple[list[int], RequestBlockHasher]] = {}
    for step in workload["steps"]:
        for op in step["ops"]:
            if op["op"] == "admit" and op["req"] not in reqs:
                lora = op.get("lora")
                rbh = RequestBlockHasher(
                    hasher,
                    lora=LoRA(lora["lora_name"], lora["lora_path"], lora["lora_int_id"]) if lora else None,
                    mm_items=[MMItem(m["identifier"], m["offset"], m["length"]) for m in op.get("mm", [])],
                    cache_salt=op.get("cache_salt"),
                )
                tokens = list(op["tokens"])
                rbh.extend(tokens)
                reqs[op["req"]] = (tokens, rbh)
            elif op["op"] == "decode":
                tokens, rbh = reqs[op["req"]]
                tokens.append(op["token"])
                rbh.extend([op["token"]])
    return reqs


def _golden_hashes_011(doc: dict) -> tuple[set[str], set[int], list[tuple[list[int], list[int]]]]:
    full: set[str] = set()
    ints: set[int] = set()
    stored: list[tuple[list[int], list[int]]] = []
    for step in doc["steps"]:
        for key in step["pool_after"]["cached"]:
            full.add(key.split("/")[0])
    for batch in doc["batches"]:
        for ev in batch["events"]:
            if ev["type"] in ("BlockStored", "BlockRemoved"):
                ints.update(ev["block_hashes"])
            if ev["type"] == "BlockStored":
                if ev["parent_block_hash"] is not None:
                    ints.add(ev["parent_block_hash"])
                stored.append((ev["block_hashes"], ev["token_ids"]))
    return full, ints, stored


def test_every_block_hash_of_the_v011_capture(golden_dir: Path, monkeypatch):
    base = golden_dir / "vllm-0.11.0"
    doc = json.loads((base / "stream.json").read_text())
    workload = json.loads((base / "workload.json").read_text())
    monkeypatch.setenv("PYTHONHASHSEED", workload["PYTHONHASHSEED"])
    hasher = VLLM_0_11.hasher("sha256_cbor", workload["block_size"])
    assert hasher.root.hex() == doc["hash"]["NONE_HASH_hex"]
    reqs = _replay_requests(workload, hasher)

    block_tokens: dict[bytes, list[int]] = {}
    for tokens, rbh in reqs.values():
        assert rbh.num_tokens == len(tokens)
        for i, d in enumerate(rbh.block_hashes):
            block_tokens[d] = tokens[i * 16 : (i + 1) * 16]
    by_int = {u64(d): toks for d, toks in block_tokens.items()}

    full, ints, stored = _golden_hashes_011(doc)
    assert full and ints and stored
    assert full <= {d.hex() for d in block_tokens}
    assert ints <= set(by_int)
    for hashes, token_ids in stored:
        assert [t for h in hashes for t in by_int[h]] == token_ids
    # The salt is hashed bare in 0.11: F's block 0 carries ("tenant-1",).
    f_tokens, f = reqs["F"]
    assert f.block_hashes[0] == cbor_sha256((hasher.root, tuple(f_tokens[:16]), ("tenant-1",)))
    assert f.wire_extra_keys == [["tenant-1"], None, None, None]


def test_every_block_hash_of_the_v033_capture(golden_dir: Path):
    base = golden_dir / "vllm-0.33.0"
    doc = json.loads((base / "stream.json").read_text())
    workload = json.loads((base / "workload.json").read_text())
    hasher = BlockHasher("sha256_cbor", workload["block_size"], seed=doc["hash"]["none_hash_seed"])
    reqs = _replay_requests(workload, hasher)
    wire_by_int: dict[int, Any] = {}
    assert set(doc["requests"]) <= set(reqs)
    for rid, rec in doc["requests"].items():
        tokens, rbh = reqs[rid]
        assert rbh.num_tokens == rec["num_tokens"] == len(tokens), rid
        assert [d.hex() for d in rbh.block_hashes] == rec["block_hashes_hex"], rid
        assert to_external_list(rbh.block_hashes) == rec["block_hashes_int"], rid
        assert to_external_list(rbh.block_hashes, "bytes") == [bytes.fromhex(x) for x in rec["block_hashes_hex"]]
        wire_by_int.update(zip(rec["block_hashes_int"], rbh.wire_extra_keys))
    checked = 0
    for batch in doc["batches"]:
        for ev in batch["events"]:
            if ev["type"] == "BlockStored" and ev["medium"] == "GPU":
                assert ev["extra_keys"] == [wire_by_int[h] for h in ev["block_hashes"]]
                checked += 1
    assert checked >= 10


def test_v033_dp1_engine_hashes(golden_dir: Path):
    doc = json.loads((golden_dir / "vllm-0.33.0" / "stream.json").read_text())
    workload = json.loads((golden_dir / "vllm-0.33.0" / "workload.json").read_text())
    hasher = BlockHasher("sha256_cbor", 16, seed="vllm-none-hash")
    (op,) = workload["dp1_step"]["ops"]
    rbh = RequestBlockHasher(hasher)
    rbh.extend(op["tokens"])
    stored = [ev for b in doc["dp1"]["batches"] for ev in b["events"] if ev["type"] == "BlockStored"]
    assert to_external_list(rbh.block_hashes) == [h for ev in stored for h in ev["block_hashes"]]


def test_seed_0_with_033_keys_matches_v011_except_the_salted_request(golden_dir: Path):
    # The 0.33 README: with seed "0", 0.33 puts the v0.11 hashes on the wire, except for
    # request F, whose salt 0.33 hashes as ("cache_salt", salt).
    workload = json.loads((golden_dir / "vllm-0.11.0" / "workload.json").read_text())
    new = _replay_requests(workload, BlockHasher("sha256_cbor", 16, seed="0", extra_key_style="0.33"))
    old = _replay_requests(workload, BlockHasher("sha256_cbor", 16, seed="0", extra_key_style="0.11"))
    assert new.keys() == old.keys()
    for rid in new:
        a, b = new[rid][1].block_hashes, old[rid][1].block_hashes
        assert len(a) == len(b) > 0
        if rid == "F":
            assert all(x != y for x, y in zip(a, b))
        else:
            assert a == b, rid


# ---------------------------------------------------------------------------------------
# Seed rules.


def test_033_rules_unset_seed_is_fixed_for_sha256_variants(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash("sha256_cbor").hex() == NONE_HASH_DEFAULT
    assert none_hash("sha256") == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert none_hash("native") == xxhash.xxh3_128_digest(b"vllm-none-hash")
    assert BlockHasher().root.hex() == NONE_HASH_DEFAULT


@pytest.mark.parametrize("algorithm", ["xxhash", "xxhash_cbor"])
def test_033_rules_unset_seed_is_random_for_xxhash(monkeypatch, algorithm):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = none_hash(algorithm), none_hash(algorithm)
    # vLLM 0.33 init_none_hash(xxhash / xxhash_cbor) with PYTHONHASHSEED unset hashes a random
    # seed string, so its NONE_HASH is a 16-byte xxh3_128 digest (measured: len 16 for both).
    assert a != b and len(a) == len(b) == 16
    assert BlockHasher(algorithm).root != BlockHasher(algorithm).root


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_011_rules_unset_seed_is_random(monkeypatch, algorithm):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a, b = none_hash(algorithm, rules="0.11"), none_hash(algorithm, rules="0.11")
    assert a != b and len(a) == 32
    assert BlockHasher(algorithm, rules="0.11").root != BlockHasher(algorithm, rules="0.11").root


@pytest.mark.parametrize("rules", ["0.33", "0.11"])
def test_pythonhashseed_is_the_seed_under_both_rules(monkeypatch, rules):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash("sha256_cbor", rules=rules).hex() == NONE_HASH_SEED0
    assert none_hash("xxhash_cbor", rules=rules) == xxhash.xxh3_128_digest(cbor2.dumps("0", canonical=True))
    assert none_hash("xxhash", rules=rules) == xxhash.xxh3_128_digest(pickle.dumps("0", protocol=5))


def test_empty_pythonhashseed_counts_as_set(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "")
    assert none_hash("sha256_cbor", rules="0.11") == cbor_sha256("")


def test_explicit_seed_overrides_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert none_hash("sha256_cbor", seed="0").hex() == NONE_HASH_SEED0
    assert BlockHasher(seed="vllm-none-hash").root.hex() == NONE_HASH_DEFAULT
    assert BlockHasher(root=b"\x01" * 32).root == b"\x01" * 32


def test_pythonhashseed_is_read_at_construction_not_later(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    h = BlockHasher()
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert h.root.hex() == NONE_HASH_SEED0
    assert BlockHasher().root == cbor_sha256("1")


# ---------------------------------------------------------------------------------------
# Algorithms.


@pytest.mark.parametrize(
    "algorithm, reference",
    [
        ("sha256", lambda o: hashlib.sha256(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)).digest()),
        ("sha256_cbor", cbor_sha256),
        ("xxhash", lambda o: xxhash.xxh3_128_digest(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))),
        ("xxhash_cbor", lambda o: xxhash.xxh3_128_digest(cbor2.dumps(o, canonical=True))),
    ],
)
def test_vllm_algorithms_chain_their_serialized_tuples(algorithm, reference):
    h = BlockHasher(algorithm, 4, seed="0")
    assert h.root == reference("0") == hash_function(algorithm)("0")
    tokens = [5, 70000, 2**33, 7] + [1, 2, 3, 4] + [9]
    extra = [("lora", "a", "/p"), None]
    d0 = reference((h.root, (5, 70000, 2**33, 7), ("lora", "a", "/p")))
    d1 = reference((d0, (1, 2, 3, 4), None))
    assert h.hash_blocks(tokens, extra_keys_per_block=extra) == [d0, d1]
    assert h.hash_block(d0, [1, 2, 3, 4]) == d1
    assert len(d0) == h.digest_size


def test_native_is_xxh3_128_of_parent_and_little_endian_uint32_tokens():
    h = BlockHasher("native", 16, seed="0")
    assert h.root == xxhash.xxh3_128_digest(b"0") and not h.vllm_compatible
    tokens = list(range(100, 132))
    d0 = xxhash.xxh3_128_digest(h.root + struct.pack("<16I", *tokens[:16]))
    d1 = xxhash.xxh3_128_digest(d0 + struct.pack("<16I", *tokens[16:]))
    assert h.hash_blocks(tokens) == [d0, d1]
    salted = h.hash_blocks(tokens, extra_keys_per_block=[("cache_salt", "s"), None])
    assert salted[0] == xxhash.xxh3_128_digest(
        h.root + struct.pack("<16I", *tokens[:16]) + cbor2.dumps(("cache_salt", "s"), canonical=True)
    )
    assert salted[0] != d0 and salted[1] != d1


def test_native_rejects_token_ids_that_do_not_fit_uint32():
    h = BlockHasher("native", 2)
    with pytest.raises(HashingError, match="uint32.*4294967296"):
        h.hash_blocks([1, 2**32])
    with pytest.raises(HashingError, match="-1"):
        h.hash_blocks([-1, 2])


def test_pickle_and_cbor_algorithms_give_different_hashes():
    digests = {a: BlockHasher(a, 16, seed="0").hash_block(None, T1_16) for a in ALGORITHMS}
    assert len(set(digests.values())) == len(ALGORITHMS)


# ---------------------------------------------------------------------------------------
# The CBOR fast path is byte-identical to cbor2.dumps + hashlib.

small_ints = st.integers(min_value=0, max_value=300)
any_ints = st.one_of(
    st.integers(min_value=0, max_value=2**17),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -1, -24, -25, -(2**64), -(2**64) - 1]),
)
extra_leaf = st.one_of(
    st.none(),
    st.booleans(),
    any_ints,
    st.text(max_size=30),
    st.binary(max_size=40),
    st.floats(allow_nan=False),  # not hand-encoded: must fall back to cbor2
)
extra_value = st.recursive(extra_leaf, lambda c: st.lists(c, max_size=4) | st.lists(c, max_size=4).map(tuple), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
    block_size=st.integers(min_value=1, max_value=30),
    data=st.data(),
)
def test_fast_cbor_path_equals_cbor2_dumps_plus_digest(algorithm, block_size, data):
    tokens = data.draw(st.lists(any_ints, max_size=block_size * 4))
    n = len(tokens) // block_size
    extras = data.draw(st.none() | st.lists(st.none() | st.lists(extra_value, max_size=4).map(tuple), min_size=n, max_size=n))
    parent = data.draw(st.none() | st.binary(min_size=1, max_size=40))
    h = BlockHasher(algorithm, block_size, seed="x")
    digest = hashlib.sha256 if algorithm == "sha256_cbor" else None

    def ref(obj):
        raw = cbor2.dumps(obj, canonical=True)
        return digest(raw).digest() if digest else xxhash.xxh3_128_digest(raw)

    expected = []
    prev = parent or h.root
    for i in range(n):
        prev = ref((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), extras[i] if extras else None))
        expected.append(prev)
    assert h.hash_blocks(tokens, parent, extras) == expected


width_class_ints = st.one_of(
    st.integers(min_value=0, max_value=23),
    st.integers(min_value=24, max_value=255),
    st.integers(min_value=256, max_value=65535),
    st.integers(min_value=65536, max_value=2**32 - 1),
    st.integers(min_value=0, max_value=128_000),
)


@settings(max_examples=80, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
    block_size=st.sampled_from([1, 2, 16, 51, 52, 64]),
    blocks=st.integers(min_value=12, max_value=40),
    data=st.data(),
)
def test_bulk_cbor_path_equals_the_naive_loop_for_long_prompts(algorithm, block_size, blocks, data):
    # Prompts of 12+ blocks take the bulk encoder (marshal columns, compaction, cut by
    # computed sizes); ids from every CBOR width class, and now and then one it cannot take
    # (bigint, negative, bool, an id >= 2**31), which must fall back without changing a digest.
    tokens = data.draw(st.lists(width_class_ints, min_size=blocks * block_size, max_size=blocks * block_size + 3))
    odd = data.draw(st.none() | st.sampled_from([2**40, -5, True, False, 2**64, 2**31, 2**32 - 1, -(2**31)]))
    if odd is not None:
        tokens[data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))] = odd
    h = BlockHasher(algorithm, block_size, seed="x")
    digest = hashlib.sha256 if algorithm == "sha256_cbor" else None
    expected = []
    prev = h.root
    for i in range(len(tokens) // block_size):
        raw = cbor2.dumps((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), None), canonical=True)
        prev = digest(raw).digest() if digest else xxhash.xxh3_128_digest(raw)
        expected.append(prev)
    assert h.hash_blocks(tokens) == expected
    assert h.hash_blocks(array("I", [t for t in tokens if type(t) is int and 0 <= t < 2**32])) == h.hash_blocks(
        [t for t in tokens if type(t) is int and 0 <= t < 2**32])


class _Tok(int):
    """An int subclass: cbor2 and pickle encode it (pickle by reduce), marshal refuses it."""


# Ids at every boundary the bulk CBOR encoder decides on: CBOR's header widths (24, 256,
# 65536), the columns it tests (b3 != 0 from 2**24 on), and marshal's exact-int32 proof
# (2**31 and up, negatives, bools and int subclasses are not int32 "i" records).
cbor_edge_ids = st.one_of(
    width_class_ints,
    st.sampled_from([0, 1, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537, 2**24 - 1, 2**24, 2**24 + 1, 2**31 - 1]),
    st.integers(min_value=2**24, max_value=2**31 - 1),
)


@settings(max_examples=120, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
    block_size=st.sampled_from([1, 3, 16, 32]),
    data=st.data(),
)
def test_bulk_cbor_ids_at_every_width_and_proof_boundary(algorithm, block_size, data):
    blocks = data.draw(st.integers(min_value=12, max_value=30))
    tokens = data.draw(st.lists(cbor_edge_ids, min_size=blocks * block_size, max_size=blocks * block_size + block_size - 1))
    odd = data.draw(st.none() | st.sampled_from([2**31, 2**32 - 1, -1, -(2**31), True, _Tok(7), _Tok(70000)]))
    if odd is not None:
        tokens[data.draw(st.integers(min_value=0, max_value=len(tokens) - 1))] = odd
    h = BlockHasher(algorithm, block_size, seed="x")
    fn = hash_function(algorithm)
    expected, prev = [], h.root
    for i in range(len(tokens) // block_size):
        prev = fn((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
        expected.append(prev)
    container = data.draw(st.sampled_from([list, tuple]))
    assert h.hash_blocks(container(tokens)) == expected
    assert RequestBlockHasher(h).extend(container(tokens)) == expected


pickle_ints = st.one_of(
    st.integers(min_value=0, max_value=255),  # BININT1
    st.integers(min_value=256, max_value=65535),  # BININT2
    st.integers(min_value=-(2**31), max_value=2**31 - 1),  # BININT
    st.integers(min_value=-(2**80), max_value=2**80),  # LONG1
    st.booleans(),  # NEWTRUE / NEWFALSE, not an int encoding
    st.sampled_from([0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -(2**31), -(2**31) - 1]),
)


@settings(max_examples=200, deadline=None)
@given(
    algorithm=st.sampled_from(["sha256", "xxhash"]),
    block_size=st.integers(min_value=1, max_value=64),
    container=st.sampled_from([list, tuple]),
    data=st.data(),
)
def test_pickle_path_equals_pickle_dumps_plus_digest(algorithm, block_size, container, data):
    # Every pickle width class, bools, negatives, big ints; extra keys present or absent;
    # a partial tail block; any parent length. vLLM hashes pickle.dumps((parent,
    # tuple(block), extra_keys), HIGHEST_PROTOCOL).
    tokens = data.draw(st.lists(pickle_ints, max_size=block_size * 5))
    n = len(tokens) // block_size
    extras = data.draw(st.none() | st.lists(st.none() | st.lists(extra_value, max_size=4).map(tuple), min_size=n, max_size=n))
    parent = data.draw(st.none() | st.binary(min_size=1, max_size=300))
    h = BlockHasher(algorithm, block_size, seed="x")

    def ref(obj):
        raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return hashlib.sha256(raw).digest() if algorithm == "sha256" else xxhash.xxh3_128_digest(raw)

    expected = []
    prev = parent or h.root
    for i in range(n):
        prev = ref((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), extras[i] if extras else None))
        expected.append(prev)
    assert h.hash_blocks(container(tokens), parent, extras) == expected
    if expected and all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        assert h.hash_blocks(array("I", tokens), parent, extras) == expected


# ---------------------------------------------------------------------------------------
# Request hasher.


@settings(max_examples=120, deadline=None)
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    style=st.sampled_from(["0.33", "0.11"]),
    tokens=st.lists(small_ints, max_size=90),
    cuts=st.lists(st.integers(min_value=0, max_value=90), max_size=8),
    salt=st.none() | st.text(min_size=1, max_size=5),
    lora=st.none() | st.builds(LoRA, st.text(max_size=5), st.text(max_size=5), st.integers(1, 9)),
)
def test_incremental_request_hasher_equals_one_shot(algorithm, style, tokens, cuts, salt, lora):
    h = BlockHasher(algorithm, 8, seed="0", extra_key_style=style)
    keys = RequestExtraKeys(lora=lora, cache_salt=salt)
    n = len(tokens) // 8
    forms = [keys.for_block(i * 8, i * 8 + 8, style) for i in range(n)]
    one_shot = h.hash_blocks(tokens, None, [f.hash_input for f in forms])

    rbh = RequestBlockHasher(h, lora=lora, cache_salt=salt)
    got: list[bytes] = []
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    for a, b in zip(bounds, bounds[1:]):
        new = rbh.extend(tokens[a:b])
        assert new == rbh.block_hashes[len(got) :]
        got += new
    assert got == rbh.block_hashes == one_shot
    assert rbh.num_tokens == len(tokens)
    assert rbh.wire_extra_keys == [f.wire for f in forms]


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(small_ints, max_size=70),
    cuts=st.lists(st.integers(min_value=0, max_value=70), max_size=8),
    spans=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=5),
)
def test_v033_mm_requests_hash_the_same_however_the_tokens_are_split(tokens, cuts, spans):
    # vLLM 0.33 starts every hashing pass at the first item still overlapping the block, so
    # a multimodal request's hashes do not depend on how its tokens arrived (0.11's do).
    items, pos = [], 0
    for i, (gap, length) in enumerate(spans):
        pos += gap
        items.append(MMItem(f"m{i % 2}", pos, length))
        pos += length
    h = BlockHasher("sha256_cbor", 4, seed="0", extra_key_style="0.33")
    keys = RequestExtraKeys(mm_items=tuple(items))
    n = len(tokens) // 4
    forms = [keys.for_block(i * 4, i * 4 + 4) for i in range(n)]
    rbh = RequestBlockHasher(h, mm_items=items)
    bounds = sorted({0, len(tokens), *(c for c in cuts if c <= len(tokens))})
    for a, b in zip(bounds, bounds[1:]):
        rbh.extend(tokens[a:b])
    assert rbh.block_hashes == h.hash_blocks(tokens, None, [f.hash_input for f in forms])
    assert rbh.wire_extra_keys == [f.wire for f in forms]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_long_prompts_through_the_request_hasher_equal_the_naive_loop(algorithm, data):
    # A prompt long enough for the bulk paths, passed as a list, a tuple or another iterable,
    # then more tokens in calls of any length (some starting at a block boundary, which hash
    # the caller's list in place): the same digests as the naive loop, and the caller's
    # lists are neither kept nor changed.
    block_size = data.draw(st.sampled_from([4, 16]))
    ids = pickle_ints if algorithm in ("sha256", "xxhash") else cbor_edge_ids
    if algorithm == "native":
        ids = st.integers(min_value=0, max_value=2**32 - 1)
    tokens = data.draw(st.lists(ids, min_size=12 * block_size, max_size=30 * block_size))
    cuts = sorted(set(data.draw(st.lists(st.integers(min_value=0, max_value=len(tokens)), max_size=6))))
    h = BlockHasher(algorithm, block_size, seed="0")
    want = h.hash_blocks(tokens)
    if algorithm != "native":
        fn, prev, naive = hash_function(algorithm), h.root, []
        for i in range(len(tokens) // block_size):
            prev = fn((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
            naive.append(prev)
        assert want == naive
    r = RequestBlockHasher(h)
    got: list[bytes] = []
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        part = data.draw(st.sampled_from([list, tuple, iter]))(tokens[a:b])
        kept = list(part) if not isinstance(part, type(iter([]))) else None
        new = r.extend(part)
        if kept is not None:
            assert list(part) == kept  # not changed
            if isinstance(part, list):
                part.append(12345)  # and not kept: changing it now changes nothing
        got += new
    assert got == r.block_hashes == want
    assert r.num_tokens == len(tokens)


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("container", [list, tuple, lambda t: array("I", t), lambda t: range(t[0], t[0] + len(t))])
def test_one_block_prompts_in_any_sequence_hash_like_vllm(algorithm, container):
    # A one-block prompt takes a single serialize + digest call, whatever sequence holds it.
    tokens = container([70000, 70001, 70002, 70003, 70004])
    h = BlockHasher(algorithm, 4, seed="x")
    want = [hash_function(algorithm)((h.root, tuple(tokens[:4]), None))]
    assert h.hash_blocks(tokens) == want
    if type(tokens) in (list, tuple):
        assert RequestBlockHasher(h).extend(tokens) == want


def test_a_refused_aligned_prompt_leaves_the_request_unchanged():
    h = BlockHasher("native", 4, seed="0")
    r = RequestBlockHasher(h)
    r.extend([1, 2, 3, 4, 5])
    before = (list(r.block_hashes), r.num_tokens)
    with pytest.raises(HashingError):
        RequestBlockHasher(h).extend([1, 2, 3, 2**40, 5, 6, 7, 8])
    r2 = RequestBlockHasher(h)
    with pytest.raises(HashingError):
        r2.extend((1, 2, 3, -1))
    assert r2.block_hashes == [] and r2.num_tokens == 0
    r2.extend([1, 2, 3, 4, 5])
    assert (r2.block_hashes, r2.num_tokens) == before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=25, deadline=None)
@given(block_size=st.integers(min_value=1, max_value=16), data=st.data())
def test_token_by_token_decode_equals_one_shot(algorithm, block_size, data):
    # A prompt, then one token per call: the decode steps that complete a block take the
    # one-block shortcut, and must hash exactly what hash_blocks does (any token value).
    tokens = data.draw(st.lists(pickle_ints, min_size=3 * block_size, max_size=6 * block_size))
    prompt_len = data.draw(st.integers(min_value=0, max_value=len(tokens) - 2 * block_size))
    h = BlockHasher(algorithm, block_size, seed="0")
    try:
        want = h.hash_blocks(tokens)
    except (HashingError, ValueError, TypeError, OverflowError, cbor2.CBOREncodeError) as exc:
        want = type(exc)
    r = RequestBlockHasher(h)
    try:
        got = list(r.extend(tokens[:prompt_len]))
        for t in tokens[prompt_len:]:
            got += r.extend([t])
    except (HashingError, ValueError, TypeError, OverflowError, cbor2.CBOREncodeError) as exc:
        got = type(exc)
    if isinstance(want, list):
        assert got == want == r.block_hashes
        assert r.wire_extra_keys == [None] * len(want) and r.num_tokens == len(tokens)
    else:
        assert not isinstance(got, list)


def test_decode_tokens_extend_without_rehashing():
    h = BlockHasher("sha256_cbor", 16, seed="0")
    rbh = RequestBlockHasher(h)
    assert len(rbh.extend(range(40))) == 2
    first = list(rbh.block_hashes)
    for t in range(40, 47):
        assert rbh.extend([t]) == []
    (new,) = rbh.extend([47])
    assert rbh.block_hashes == first + [new] and rbh.num_tokens == 48
    assert new == h.hash_block(first[-1], list(range(32, 48)))
    assert rbh.extend([]) == []


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=25, deadline=None)
@given(block_size=st.integers(min_value=1, max_value=16), data=st.data())
def test_appended_tokens_hash_like_one_extend_per_token(algorithm, block_size, data):
    # appender() only holds a token back; the next extend() (which returns them) or read of
    # block_hashes hashes the blocks it completed: the same digests as one extend([t]) per
    # token and as hash_blocks, whatever mix of appends, extends and reads feeds them.
    ids = st.integers(min_value=0, max_value=2**32 - 1) if algorithm == "native" else pickle_ints
    tokens = data.draw(st.lists(ids, min_size=2 * block_size, max_size=6 * block_size))
    prompt_len = data.draw(st.integers(min_value=0, max_value=len(tokens)))
    h = BlockHasher(algorithm, block_size, seed="0")
    want = h.hash_blocks(tokens)
    r = RequestBlockHasher(h)
    r.extend(tokens[:prompt_len])
    append = r.appender()
    seen = len(r.block_hashes)
    for t in tokens[prompt_len:]:
        step = data.draw(st.sampled_from(["append", "append", "append", "extend", "read"]))
        if step == "extend":
            new = r.extend([t])
            assert new == r.block_hashes[seen:]
            seen = len(r.block_hashes)
        else:
            append(t)
            if step == "read":
                assert r.block_hashes == want[: len(r.block_hashes)]
                seen = len(r.block_hashes)
        assert r.num_tokens <= len(tokens)
    assert r.num_tokens == len(tokens)
    assert r.block_hashes == want and r.wire_extra_keys == [None] * len(want)


def test_a_bad_id_appended_is_refused_when_its_block_is_hashed():
    h = BlockHasher("native", 4, seed="0")
    r = RequestBlockHasher(h)
    first = r.extend([1, 2, 3, 4, 5])
    append = r.appender()
    append(6)
    append(2**40)  # not checked yet: a plain list append
    assert r.block_hashes == first and r.num_tokens == 7
    append(8)  # completes block 1: hashing it now refuses the id, loses nothing
    with pytest.raises(HashingError, match="uint32"):
        r.block_hashes
    with pytest.raises(HashingError, match="uint32"):
        r.extend([9])
    assert r.num_tokens == 8  # the refused call's token was taken back out


@pytest.mark.parametrize("style", ["0.33", "0.11"])
def test_appended_decode_tokens_follow_vllms_multimodal_rule(style):
    # Blocks completed by appender() are hashed one pass per block, as one extend([t]) per
    # token hashes them (vLLM's per-call multimodal cursor), even when one read hashes several.
    items = [MMItem("a", 2, 3), MMItem("img", 20, 12)]
    h = BlockHasher("sha256_cbor", 16, seed="0", extra_key_style=style)
    ref = RequestBlockHasher(h, mm_items=items, cache_salt="s")
    r = RequestBlockHasher(h, mm_items=items, cache_salt="s")
    ref.extend(range(20))
    r.extend(range(20))
    append = r.appender()
    for t in range(20, 70):
        ref.extend([t])
        append(t)
    assert r.block_hashes == ref.block_hashes and len(r.block_hashes) == 4
    assert r.wire_extra_keys == ref.wire_extra_keys
    assert r.num_tokens == ref.num_tokens == 70


def test_mm_request_prompt_then_decode_matches_one_shot_for_one_item():
    h = BlockHasher("sha256_cbor", 16, seed="0")
    item = MMItem(MM_ID, 4, 30)  # blocks 0, 1 and 2 (tokens 32..33)
    rbh = RequestBlockHasher(h, mm_items=[item])
    rbh.extend(range(40))
    for t in range(40, 64):
        rbh.extend([t])
    keys = RequestExtraKeys(mm_items=(item,))
    extras = [keys.for_block(s, s + 16).hash_input for s in range(0, 64, 16)]
    assert extras[2] == (("mm", MM_ID, -28),) and extras[3] is None
    assert rbh.block_hashes == h.hash_blocks(list(range(64)), None, extras)
    assert rbh.wire_extra_keys == [[[MM_ID, 4]], [[MM_ID, -12]], [[MM_ID, -28]], None]


def test_v011_attaches_an_item_that_ended_where_a_later_pass_starts():
    # vLLM 0.11 compares "start > item_end" and looks only at the last item in passes
    # after the prompt: block [32, 48) completed by decode still carries the item that
    # ended at 32. 0.33 fixed the comparison.
    item = MMItem("img", 20, 12)
    for style, block2 in (("0.11", ("img",)), ("0.33", None)):
        h = BlockHasher("sha256_cbor", 16, seed="0", extra_key_style=style)
        rbh = RequestBlockHasher(h, mm_items=[item])
        rbh.extend(range(32))
        rbh.extend(range(32, 48))
        b1 = ("img",) if style == "0.11" else (("mm", "img", 4),)
        assert rbh.block_hashes == h.hash_blocks(list(range(48)), None, [None, b1, block2])


# Items a [16, 18) and b [18, 20), a 20-token prompt (block 0 only), then 12 output tokens
# complete block 1 in a later hashing pass. Digests from vLLM's own request block hasher
# (get_request_block_hasher(16, sha256_cbor), PYTHONHASHSEED=0, the prompt then one
# append of tokens 20..31): 0.11.0 and 0.33.0.
_LATER_PASS_BLOCK0 = "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c"
_LATER_PASS_BLOCK1 = {
    "0.11": "1dc055840f6eaa2d07828af1d204f90cf3441ace14b43bacd7d39a0f2f70a1d7",
    "0.33": "7ff6137035988def658bc8daf3a6d85fb193841abaae77523c280b7df5fa6a06",
}


def test_v011_later_pass_sees_only_the_last_mm_item_like_vllm():
    # vLLM 0.11 starts a later pass's multimodal cursor at the last item (start_mm_idx=-1).
    items = [MMItem("a", 16, 2), MMItem("b", 18, 2)]
    h = BlockHasher("sha256_cbor", 16, seed="0", extra_key_style="0.11")
    rbh = RequestBlockHasher(h, mm_items=items)
    rbh.extend(range(20))  # the prompt completes block 0 only
    rbh.extend(range(20, 32))  # block 1 completes in a later pass
    assert rbh.wire_extra_keys == [None, ["b"]]
    assert [d.hex() for d in rbh.block_hashes] == [_LATER_PASS_BLOCK0, _LATER_PASS_BLOCK1["0.11"]]


def test_v033_later_pass_sees_every_mm_item_overlapping_the_block():
    # vLLM 0.33 starts a later pass at the first item still overlapping the block
    # (get_mm_features_in_window), so block 1 carries both a and b, like the prompt pass.
    items = [MMItem("a", 16, 2), MMItem("b", 18, 2)]
    h = BlockHasher("sha256_cbor", 16, seed="0", extra_key_style="0.33")
    rbh = RequestBlockHasher(h, mm_items=items)
    rbh.extend(range(20))
    rbh.extend(range(20, 32))
    assert rbh.wire_extra_keys == [None, [["a", 0], ["b", 2]]]
    assert RequestExtraKeys(mm_items=tuple(items)).for_block(16, 32).wire == [["a", 0], ["b", 2]]
    assert [d.hex() for d in rbh.block_hashes] == [_LATER_PASS_BLOCK0, _LATER_PASS_BLOCK1["0.33"]]


def test_v033_decode_block_keeps_an_item_that_started_in_the_prompt_blocks():
    # bs 4, a 10-token prompt, img-a [5, 9) and img-b [9, 10); block 2 [8, 12) completes
    # when two output tokens arrive. vLLM 0.33's hasher gives block 2 the extra keys
    # (("mm", "img-a", -3), ("mm", "img-b", 1)); digests from get_request_block_hasher(4,
    # sha256_cbor) with PYTHONHASHSEED=0, the prompt then append_output_token_ids([11, 12]).
    items = [MMItem("img-a", 5, 4), MMItem("img-b", 9, 1)]
    rbh = RequestBlockHasher(VLLM_0_33.hasher("sha256_cbor", 4, seed="0"), mm_items=items)
    rbh.extend(list(range(1, 11)))
    rbh.extend([11, 12])
    assert [d.hex() for d in rbh.block_hashes] == [
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
        "3ed724855019a75df865d9f5e1c773c29b575c3cb763610c56297e902a56c2c6",
        "94777de65fe6d3a35bd4d3697c50871c98a3c2b0c03ae0bac51f7d486fcb6b94",
    ]
    assert rbh.wire_extra_keys[2] == [["img-a", -3], ["img-b", 1]]


def test_extra_key_forms_in_both_styles():
    keys = RequestExtraKeys(
        lora=LoRA("ad", "/p/ad", 7),
        mm_items=(MMItem("i1", 2, 4),),
        cache_salt="t",
        prompt_embeds_digest=lambda s, e: bytes([s, e]),
    )
    assert keys.for_block(0, 16, "0.33") == (
        (("lora", "ad", "/p/ad"), ("mm", "i1", 2), ("cache_salt", "t"), ("prompt_embeds", b"\x00\x10")),
        ["ad", ["i1", 2], "t", b"\x00\x10"],
    )
    assert keys.for_block(0, 16, "0.11") == ((7, "i1", "t", b"\x00\x10"), [7, "i1", "t", b"\x00\x10"])
    assert keys.for_block(16, 32, "0.33").hash_input == (("lora", "ad", "/p/ad"), ("prompt_embeds", b"\x10\x20"))
    assert RequestExtraKeys(cache_salt="").for_block(0, 16) == (None, None)


# ---------------------------------------------------------------------------------------
# External form and errors.


def test_external_form_is_the_last_8_bytes_big_endian():
    d = bytes(range(32))
    assert to_external(d) == int.from_bytes(d[-8:], "big") == u64(d)
    assert to_external(d, "bytes") == d
    x = bytes(range(16))
    assert to_external_list([d, x]) == [u64(d), u64(x)]
    with pytest.raises(HashingError, match="'int' or 'bytes'"):
        to_external(d, "hex")


@pytest.mark.parametrize("bad", ["sha1", "SHA256", "", None, "sha256-cbor"])
def test_unknown_algorithm_names_are_rejected_with_the_valid_list(bad):
    with pytest.raises(HashingError, match="sha256_cbor.*native"):
        BlockHasher(bad)
    with pytest.raises(HashingError, match="unknown block hash algorithm"):
        none_hash(bad)


@pytest.mark.parametrize("bad", [0, -16, 1.5, True, "16", None])
def test_bad_block_sizes_are_rejected(bad):
    with pytest.raises(HashingError, match="block_size must be a positive int"):
        BlockHasher("sha256_cbor", bad)


def test_other_bad_arguments_say_what_to_do():
    with pytest.raises(HashingError, match="'0.33' or '0.11'"):
        none_hash("sha256", rules="0.12")
    with pytest.raises(HashingError, match="extra_key_style"):
        BlockHasher(extra_key_style="new")
    with pytest.raises(HashingError, match="root must be non-empty bytes"):
        BlockHasher(root=b"")
    h = BlockHasher("sha256_cbor", 4, seed="0")
    with pytest.raises(HashingError, match="exactly block_size=4 tokens, got 3"):
        h.hash_block(None, [1, 2, 3])
    with pytest.raises(HashingError, match="one entry .* per full block"):
        h.hash_blocks(list(range(8)), None, [None])
    with pytest.raises(HashingError, match=r"wrap a single token as \[token\]"):
        RequestBlockHasher(h).extend(5)  # type: ignore[arg-type]
    with pytest.raises(HashingError, match="sorted by offset"):
        RequestExtraKeys(mm_items=(MMItem("b", 9, 1), MMItem("a", 2, 1)))
    with pytest.raises(HashingError, match="length > 0"):
        RequestExtraKeys(mm_items=(MMItem("a", 0, 0),))
    with pytest.raises(HashingError, match="not arbitrary objects"):
        hash_function("native")
    with pytest.raises(AttributeError, match="immutable"):
        h.block_size = 8  # type: ignore[misc]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([8, 16, 32, 12]).flatmap(lambda n: st.binary(min_size=n, max_size=n)), max_size=20))
def test_external_list_equals_per_digest_conversion(digests):
    from kvstream.hashing import to_external, to_external_list

    assert to_external_list(digests) == [to_external(d) for d in digests]
    same = [d for d in digests if len(d) == 32]
    assert to_external_list(same) == [int.from_bytes(d[-8:], "big") for d in same]


# ---------------------------------------------------------------------------------------
# Short prompts and decode steps: the simple per-block loop and its crossovers.

VLLM_ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def naive_chain(algorithm: str, root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    fn, prev, out = hash_function(algorithm), root, []
    for i in range(len(tokens) // block_size):
        prev = fn((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
        out.append(prev)
    return out


@pytest.mark.parametrize("algorithm", VLLM_ALGOS)
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 31, 32, 33, 79, 80, 81, 191, 192, 193])
def test_edge_lengths_one_shot_and_request_equal_the_naive_loop(algorithm, length):
    # Around one block and both crossovers (pickle: 5 blocks, CBOR: 12 blocks), as a list
    # and as a tuple, in one call and token by token.
    tokens = [(i * 7919) % 131072 for i in range(length)]
    h = BlockHasher(algorithm, 16, seed="edge")
    want = naive_chain(algorithm, h.root, tokens, 16)
    assert h.hash_blocks(tokens) == h.hash_blocks(tuple(tokens)) == want
    r = RequestBlockHasher(h)
    assert r.extend(tokens) == want and r.num_tokens == length
    assert r.wire_extra_keys == [None] * len(want)
    r = RequestBlockHasher(h)
    got: list[bytes] = []
    for t in tokens:
        got += r.extend((t,))
    assert got == r.block_hashes == want


@pytest.mark.parametrize("algorithm", VLLM_ALGOS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_splits_of_short_prompts_equal_the_naive_loop(algorithm, data):
    # Any prompt up to ~14 blocks, cut anywhere, each part a list, a tuple or an iterator,
    # with the decode tail one token per call; any root length (a custom root is not a
    # digest of the algorithm's size): the same digests as the naive loop.
    block_size = data.draw(st.sampled_from([1, 3, 16]))
    ids = pickle_ints if algorithm in ("sha256", "xxhash") else cbor_edge_ids
    tokens = data.draw(st.lists(ids, max_size=14 * block_size))
    root = data.draw(st.none() | st.binary(min_size=1, max_size=40))
    h = BlockHasher(algorithm, block_size, seed="0", root=root)
    want = naive_chain(algorithm, h.root, tokens, block_size)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(tokens)), max_size=5))))
    r = RequestBlockHasher(h)
    got: list[bytes] = []
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        part = data.draw(st.sampled_from([list, tuple, iter]))(tokens[a:b])
        got += r.extend(part)
    assert got == r.block_hashes == want
    assert r.num_tokens == len(tokens)
    split = data.draw(st.integers(0, len(tokens)))
    one_shot = h.hash_blocks(tokens[: split - split % block_size])
    assert one_shot + h.hash_blocks(tokens[split - split % block_size :], one_shot[-1] if one_shot else None) == want


@pytest.mark.parametrize("algorithm", VLLM_ALGOS)
def test_a_decode_step_with_a_bad_token_leaves_the_request_unchanged(algorithm):
    # A token the serializer refuses (an object; pickle cannot pickle a lambda either) in
    # a call that completes a block: the call raises, the request is as before it.
    h = BlockHasher(algorithm, 4, seed="0")
    r = RequestBlockHasher(h)
    r.extend([1, 2, 3, 4, 5, 6])
    before = (list(r.block_hashes), r.num_tokens)
    with pytest.raises(Exception):
        r.extend([7, lambda: 0])  # type: ignore[list-item]
    assert (r.block_hashes, r.num_tokens) == before
    r.extend((7,))
    assert r.extend((8,)) == naive_chain(algorithm, h.root, [1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]
