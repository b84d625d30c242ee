"""Differential check: vLLM's real BlockPool and block hashing against kvstream's, step by step.

Usage (from the repository root, with kvstream's venv)::

    .venv/bin/python bench/vllm_peer/diff_pool.py                 # both releases, default cases
    .venv/bin/python bench/vllm_peer/diff_pool.py --cases 5000    # more seeded cases per part
    .venv/bin/python bench/vllm_peer/diff_pool.py --release 0.33 --part pool --one 17 -v

Each difference is printed with the seed of its case; ``--one SEED`` replays just that case.
For each release (0.11, 0.33) one worker process imports vLLM's own ``block_pool.py``,
``kv_cache_utils.py``, ``kv_events.py`` (and 0.33's ``utils/hashing.py``) unmodified through
``shims.py`` and runs seeded random cases through vLLM and kvstream side by side:

* **pool**: traces of admissions (prefix lookup by ``get_cached_block`` and by kvstream's
  ``cached_prefix``, ``touch``, ``get_new_blocks``, ``cache_full_blocks`` whole or in
  chunks with ``num_cached_blocks > 0``), decode steps that complete blocks, frees in
  vLLM's order (reverse) and in other orders, preemption, ``reset_prefix_cache`` with and
  without blocks in use, over-asking ``get_new_blocks``, 0.33's ``emit_cached_block_events``
  vs kvstream's ``announce_cached_prefix``; pools of 2-4 blocks up to 256, one or two KV
  cache groups, hit-heavy and miss-heavy vocabularies, events and caching on/off, int and
  bytes hash forms, a ``medium`` other than GPU (0.33), LoRA, cache salt, multimodal items
  and session ids. A probe hands the null block to ``free_blocks``, ``touch`` and (0.33)
  ``cache_full_blocks``. After every step it compares the returned
  block ids, errors, the free queue's order, the cached map (hash, group) -> block ids in
  lookup order, every block's hash and ref count, free count, usage and the events taken
  (type, order and every field the release's pool fills).
* **manager**: kvstream's ``KVCacheManager`` (``admit`` whole or chunked, ``allocate``,
  ``decode``, ``free``, ``reset_prefix_cache``) against vLLM's pool driven with the calls
  vLLM's ``KVCacheManager`` makes (as ``workloads.py`` models them: lookup capped one token
  short of the prompt, the release's reservation rule, blocks cached as their last token
  is scheduled, frees in reverse); the same comparisons, plus block tables, computed tokens
  and admission/decode outcomes; in 0.11 also ``PrefixCachingMetrics`` (the hit-rate window)
  against vLLM's, fed the same random stats.
* **hash**: every algorithm the release has (0.11: sha256, sha256_cbor; 0.33: also
  xxhash, xxhash_cbor), NONE_HASH under PYTHONHASHSEED set (random strings, "" included)
  and unset (0.33's fixed seed for sha256*, a random root otherwise: compared by length
  and by being fresh), block sizes 1..64, empty and partial prompts, token ids across the
  CBOR size classes, LoRA, cache salt, multimodal items spanning block boundaries, prompt
  embeddings (0.33), and the request hasher fed as vLLM's ``Request`` is (prompt, then
  outputs one token or a few per step) against ``RequestBlockHasher.extend`` / ``appender``
  (the prompt as a list, tuple, iterator or ``array``); per block, ``for_block`` against
  ``generate_block_hash_extra_keys`` (and 0.33's ``to_event_extra_keys``); ``hash_block``
  and ``hash_blocks`` with arbitrary extra keys against ``hash_block_tokens``;
  ``hash_function`` and ``to_external`` against vLLM's hash functions and
  ``maybe_convert_block_hash``.

Fields vLLM's pool does not fill but a layer above it does (0.33's ``kv_cache_spec_kind``
and ``kv_cache_spec_sliding_window``) are not compared here; the golden replays cover them.
Known, documented differences are counted apart from failures (see ``KNOWN``): they are
places where vLLM itself is the odd one or where kvstream refuses a call on purpose.

Exit status 1 if anything differed outside ``KNOWN``. Needs the cache ``fetch.py`` fills
(the first run downloads the wheels; later runs need no network). Not part of CI.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import traceback
import zipfile
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository (kvstream)

from vllm_peer import fetch  # noqa: E402

RELEASES = ("0.11", "0.33")
DEFAULT_CASES = {"pool": 2000, "manager": 1000, "hash": 10000}

# Differences that are understood and documented (docs/allocator.md, docs/hashing.md):
# counted and shown, but not failures.
KNOWN = {
    # kvstream refuses the null block in free_blocks/touch (a LocalProtocolError, nothing
    # changes); vLLM 0.33 skips it and 0.11 counts it (its ref_cnt goes negative).
    "null-block-refused",
}


class Diff(Exception):
    """One difference between vLLM and kvstream (a category and what was seen)."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail


def _expect(category: str, ours: Any, theirs: Any, what: str = "") -> None:
    if ours != theirs:
        raise Diff(category, f"{what} kvstream={_short(ours)} vllm={_short(theirs)}")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 600 else s[:600] + "..."


# --------------------------------------------------------------------------------------
# What vLLM's pool and hasher read of a request (vllm.v1.request.Request's fields).


class PeerLoRA:
    """vLLM's ``LoRARequest`` fields the pool and hasher read (0.11's pool reads ``.id``,
    which 0.11's LoRARequest lacks: with events on and a LoRA request it raises
    AttributeError; the stand-in answers with ``lora_int_id``, what kvstream emits)."""

    def __init__(self, name: str, int_id: int, path: str) -> None:
        self.lora_name = name
        self.lora_int_id = int_id
        self.lora_path = path

    adapter_id = property(lambda self: self.lora_int_id)
    id = property(lambda self: self.lora_int_id)
    name = property(lambda self: self.lora_name)
    path = property(lambda self: self.lora_path)


class PeerPos:
    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length


class PeerMM:
    def __init__(self, identifier: str, offset: int, length: int) -> None:
        self.identifier = identifier
        self.mm_position = PeerPos(offset, length)


class PeerEmbeds:
    """Prompt embeddings: one bytes row per token; slicing gives rows (``tensor_data`` joins)."""

    def __init__(self, rows: list[bytes]) -> None:
        self.rows = rows

    def __getitem__(self, s: slice) -> list[bytes]:
        return self.rows[s]


class PeerRequest:
    def __init__(self, rid: Any, tokens: list[int], hasher: Callable[[Any], list[bytes]] | None, *,
                 lora: PeerLoRA | None = None, mm: list[PeerMM] | None = None, salt: str | None = None,
                 embeds: PeerEmbeds | None = None, session: str | None = None) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.lora_request = lora
        self.mm_features = mm or []
        self.cache_salt = salt
        self.prompt_embeds = embeds
        self._prompt_embeds_per_block_hashes: dict[Any, bytes] = {}
        self.session_id = session
        self._hasher = hasher
        self.block_hashes: list[bytes] = []
        if hasher is not None:
            self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, tokens: list[int]) -> None:
        # vLLM's Request.append_output_token_ids: append, then hash what they completed.
        self.all_token_ids.extend(tokens)
        if self._hasher is not None:
            self.block_hashes.extend(self._hasher(self))


def _install_mm_window(vl: Any, release: str) -> bool:
    """vLLM 0.33's hasher calls ``vllm.multimodal.utils.get_mm_features_in_window``, a module
    the peer does not import (it needs numpy and PIL). Execute that one real function, read
    from the release's wheel, into the stand-in module. False if the wheel is not cached."""
    if release != "0.33":
        return True
    wheels = sorted((fetch.cache_dir() / "wheels" / release).glob("*.whl"))
    if not wheels:
        return False
    with zipfile.ZipFile(wheels[-1]) as whl:
        src = whl.read("vllm/multimodal/utils.py").decode()
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "get_mm_features_in_window")
    fn.returns = None
    for a in fn.args.args:
        a.annotation = None
    ns: dict[str, Any] = {"bisect": bisect}
    exec(compile(ast.Module([fn], []), "vllm/multimodal/utils.py", "exec"), ns)
    real = ns["get_mm_features_in_window"]
    for mod in (vl.kv_cache_utils, vl.block_pool):
        if hasattr(mod, "get_mm_features_in_window"):
            mod.get_mm_features_in_window = real
    return True


def _install_tensor_data(vl: Any) -> None:
    # 0.33 hashes prompt embeddings as sha256(tensor_data(embeds[start:end])).
    if hasattr(vl.kv_cache_utils, "tensor_data"):
        vl.kv_cache_utils.tensor_data = lambda rows: b"".join(rows)


# --------------------------------------------------------------------------------------
# Random inputs.

_SPECIAL_IDS = [0, 1, 23, 24, 255, 256, 65535, 65536, (1 << 24) - 1, 1 << 24, (1 << 31) - 1]


def _tokens(rng: random.Random, n: int, vocab: int, odd: bool = False) -> list[int]:
    if odd:
        extra = [(1 << 31), (1 << 32) + 5, (1 << 64) + 1, -1, -(1 << 40), True, False]
        return [rng.choice(_SPECIAL_IDS + extra) if rng.random() < 0.3 else rng.randrange(vocab)
                for _ in range(n)]
    return [rng.choice(_SPECIAL_IDS) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(n)]


def _mm_items(rng: random.Random, prompt_len: int) -> list[tuple[str, int, int]]:
    """Sorted, non-overlapping (identifier, offset, length) placeholders within the prompt."""
    items = []
    pos = rng.randrange(0, max(1, prompt_len // 3) + 1)
    while pos < prompt_len and len(items) < 4:
        length = rng.randrange(1, max(2, min(prompt_len - pos, 40)) + 1)
        if pos + length > prompt_len:
            break
        items.append((f"mm-{rng.randrange(6)}", pos, length))
        pos += length + rng.choice([0, 0, 1, rng.randrange(0, 20)])
    return items


# --------------------------------------------------------------------------------------
# The hashing part.


def _kv_request_hasher(release: str, alg: str, bs: int, lora: Any, mm: list[tuple[str, int, int]],
                       salt: str | None, embeds: PeerEmbeds | None) -> Any:
    from kvstream.hashing import LoRA, MMItem, RequestBlockHasher
    from kvstream.compat import version

    hasher = version(release).hasher(alg, bs)
    ped = None
    if embeds is not None:
        rows = embeds.rows

        def ped(start: int, end: int) -> bytes:
            return hashlib.sha256(b"".join(rows[start:end])).digest()

    return RequestBlockHasher(
        hasher,
        lora=LoRA(lora.lora_name, lora.lora_path, lora.lora_int_id) if lora else None,
        mm_items=[MMItem(i, o, n) for i, o, n in mm],
        cache_salt=salt,
        prompt_embeds_digest=ped,
    )


def hash_case(vl: Any, release: str, seed: int, algorithms: list[str]) -> None:
    """One random request hashed by both sides, token batch by token batch."""
    from kvstream.hashing import none_hash

    rng = random.Random(seed)
    kcu = vl.kv_cache_utils
    alg = algorithms[seed % len(algorithms)]
    fn = getattr(vl.hashing, alg)
    # NONE_HASH: set to a random string ("" included) or unset.
    env_mode = rng.random()
    if env_mode < 0.75:
        os.environ["PYTHONHASHSEED"] = rng.choice(["", "0", "42", "vllm-none-hash", "ünï", str(rng.random())])
    else:
        os.environ.pop("PYTHONHASHSEED", None)
    kcu.init_none_hash(fn)
    theirs_root = kcu.NONE_HASH
    ours_root = none_hash(alg, rules=release)
    random_root = "PYTHONHASHSEED" not in os.environ and (release == "0.11" or alg.startswith("xxhash"))
    if random_root:
        kcu.init_none_hash(fn)
        _expect("none-hash-random", len(ours_root), len(theirs_root), f"{alg} random root length (bytes)")
        _expect("none-hash-random", none_hash(alg, rules=release) != ours_root, kcu.NONE_HASH != theirs_root,
                f"{alg} random root is fresh per call")
        # Hash the rest with vLLM's root (the seed is random: nothing to reproduce).
        os.environ["PYTHONHASHSEED"] = "diff"
        kcu.init_none_hash(fn)
    else:
        _expect("none-hash", ours_root, theirs_root, f"{alg} PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED')!r}")
    bs = rng.choice([1, 2, 3, 16, 16, 16, 64, rng.randrange(1, 40)])
    shape = rng.random()
    if shape < 0.1:
        plen = 0
    elif shape < 0.35:
        plen = bs * rng.randrange(1, 6)
    else:
        plen = rng.randrange(0, bs * 6 + 2)
    prompt = _tokens(rng, plen, rng.choice([50, 32_000, 1 << 20]), odd=rng.random() < 0.1)
    lora = PeerLoRA(f"adapter-{rng.randrange(3)}", rng.randrange(1, 9), f"/loras/{rng.randrange(3)}") \
        if rng.random() < 0.3 else None
    salt = rng.choice([None, None, "", "tenant-a", "t-" + str(rng.randrange(99))]) if rng.random() < 0.4 else None
    mm = _mm_items(rng, plen) if rng.random() < 0.35 and plen else []
    embeds = None
    if release == "0.33" and rng.random() < 0.15 and plen:
        embeds = PeerEmbeds([rng.randbytes(8) for _ in range(plen)])
    outputs = _tokens(rng, rng.randrange(0, bs * 5 + 3), 32_000)
    # vLLM's request, with the release's own hasher.
    vhasher = kcu.get_request_block_hasher(bs, fn)
    try:
        vreq = PeerRequest("r", prompt, vhasher, lora=lora, salt=salt, embeds=embeds,
                           mm=[PeerMM(i, o, n) for i, o, n in mm])
        v_err = None
    except Exception as exc:  # vLLM cannot hash it (an odd token id with cbor/pickle)
        v_err = type(exc).__name__
    ours = _kv_request_hasher(release, alg, bs, lora, mm, salt, embeds)
    # kvstream's hasher was built with the environment as it is now, like vLLM's root.
    _expect("none-hash", ours.hasher.root, kcu.NONE_HASH, "request hasher root")
    # The prompt as a list, or in another container kvstream accepts (same ids, same hashes).
    shape_in = rng.random()
    if shape_in < 0.1:
        given: Any = tuple(prompt)
    elif shape_in < 0.2:
        given = iter(prompt)
    elif shape_in < 0.3 and all(type(t) is int and 0 <= t < 1 << 32 for t in prompt):
        from array import array

        given = array("I", prompt)
    else:
        given = prompt
    try:
        ours.extend(given)
        o_err = None
    except Exception as exc:
        o_err = type(exc).__name__
    if v_err or o_err:
        _expect("hash-error", o_err is not None, v_err is not None, f"{alg} prompt {prompt[:8]}... raises")
        return
    where = f"{alg} bs={bs} prompt={plen} lora={bool(lora)} salt={salt!r} mm={mm} embeds={bool(embeds)}"
    _expect("hash-prompt", ours.block_hashes, vreq.block_hashes, where)
    i = 0
    feed = rng.random()
    append = ours.appender() if feed < 0.3 else None
    while i < len(outputs):
        k = 1 if feed < 0.6 else rng.randrange(1, bs + 3)
        chunk = outputs[i:i + k]
        i += k
        vreq.append_output_token_ids(chunk)
        if append is not None:
            for t in chunk:
                append(t)
        else:
            ours.extend(chunk)
        if rng.random() < 0.5 or i >= len(outputs):
            _expect("hash-decode", ours.block_hashes, vreq.block_hashes,
                    f"{where} after {i} outputs ({'appender' if append else 'extend'})")
    _expect("hash-num-tokens", ours.num_tokens, vreq.num_tokens)
    # Per block, for_block's two forms against vLLM's extra keys of one pass over the whole
    # request (its cursor carried from block 0, as a prompt is hashed) and, in 0.33, of the
    # block on its own (cursor 0: what its pool puts on events), with the event form.
    keys = ours.keys
    cursor = 0
    for start in range(0, vreq.num_tokens - bs + 1, bs):
        v_keys, cursor = kcu.generate_block_hash_extra_keys(vreq, start, start + bs, cursor)
        got = keys.for_block(start, start + bs, release)
        _expect("extra-keys", _norm(got.hash_input), _norm(v_keys), f"{where} block at {start}")
        if release == "0.33":
            alone, _ = kcu.generate_block_hash_extra_keys(vreq, start, start + bs, 0)
            _expect("extra-keys", _norm(got.hash_input), _norm(alone), f"{where} block at {start} alone")
            _expect("extra-keys-wire", _norm(got.wire), _norm(kcu.to_event_extra_keys([alone])[0]),
                    f"{where} block at {start}")
    # One block with arbitrary extra keys through hash_block / hash_blocks, and the wire form.
    h = ours.hasher
    if vreq.num_tokens >= bs:
        blk = vreq.all_token_ids[:bs]
        ek = rng.choice([None, (1,), ("x", b"y", -5), (("lora", "n", "p"), ("mm", "id", -3)),
                         (rng.randrange(1 << 70), "ü", (True, None)), ((b"", ()),)])
        parent = rng.choice([None, vreq.block_hashes[0]])
        try:
            theirs = kcu.hash_block_tokens(fn, parent, blk, ek)
        except Exception as exc:
            theirs = type(exc).__name__
        try:
            mine: Any = h.hash_block(parent, blk, ek)
        except Exception as exc:
            mine = type(exc).__name__
        _expect("hash-block", mine, theirs, f"{alg} parent={parent is not None} extra={ek!r}")
        one = h.hash_blocks(vreq.all_token_ids[:bs], parent, [ek]) if not isinstance(theirs, str) else theirs
        _expect("hash-block", one, [theirs] if not isinstance(theirs, str) else theirs, "hash_blocks")
    from kvstream.hashing import hash_function, to_external

    if alg in ("sha256", "sha256_cbor") or release == "0.33":
        obj = (vreq.block_hashes[:1], tuple(prompt[:5]), salt)
        _expect("hash-function", hash_function(alg)(obj), fn(obj), alg)
    envs = sys.modules["vllm.envs"]
    for d in vreq.block_hashes[:3]:
        for as_int in (True, False):
            envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = as_int  # type: ignore[attr-defined]
            _expect("external-form", to_external(d, "int" if as_int else "bytes"), kcu.maybe_convert_block_hash(d))
    envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# The pool part.


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _events_vllm(events: list[Any], release: str) -> list[tuple[Any, ...]]:
    out = []
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            row: tuple[Any, ...] = ("S", _norm(e.block_hashes), e.parent_block_hash, _norm(e.token_ids),
                                    e.block_size, e.lora_id, e.medium)
            if release == "0.33":
                row += (e.lora_name, _norm(e.extra_keys), e.group_idx, e.session_id)
            out.append(row)
        elif name == "BlockRemoved":
            row = ("R", _norm(e.block_hashes), e.medium)
            if release == "0.33":
                row += (e.group_idx,)
            out.append(row)
        else:
            out.append(("C",))
    return out


def _events_ours(events: list[Any], release: str) -> list[tuple[Any, ...]]:
    out = []
    for e in events:
        name = type(e).__name__
        if name == "BlockStored":
            row: tuple[Any, ...] = ("S", _norm(e.block_hashes), e.parent_block_hash, _norm(e.token_ids),
                                    e.block_size, e.lora_id, e.medium)
            if release == "0.33":
                row += (e.lora_name, _norm(e.extra_keys), e.group_idx, e.session_id)
            else:
                _expect("event-0.11-fields", (e.lora_name, e.extra_keys, e.group_idx, e.session_id),
                        (None, None, None, None), "0.11-style BlockStored carries 0.33 fields")
            out.append(row)
        elif name == "BlockRemoved":
            row = ("R", _norm(e.block_hashes), e.medium)
            if release == "0.33":
                row += (e.group_idx,)
            else:
                _expect("event-0.11-fields", e.group_idx, None, "0.11-style BlockRemoved group_idx")
            out.append(row)
        else:
            out.append(("C",))
    return out


class PoolPair:
    """vLLM's pool and kvstream's, driven with the same calls; compared after each."""

    def __init__(self, vl: Any, release: str, num_blocks: int, bs: int, caching: bool, events: bool,
                 int_hashes: bool, groups: int = 1, medium: str = "GPU") -> None:
        from kvstream.allocator import BlockPool

        self.release = release
        self.bs = bs
        self.events = events
        sys.modules["vllm.envs"].VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = int_hashes  # type: ignore[attr-defined]
        if release == "0.11":
            self.v = vl.block_pool.BlockPool(num_blocks, caching, events)
        else:
            self.v = vl.block_pool.BlockPool(num_blocks, caching, bs, events, medium=medium)
        self.o = BlockPool(num_blocks, bs, enable_caching=caching, enable_kv_cache_events=events,
                           hash_form="int" if int_hashes else "bytes", release=release, medium=medium,
                           kv_cache_event_metadata=(("full_attention", None),) * groups)
        self.seen: dict[str, int] = {}  # what the trace exercised (coverage, for the report)

    def saw(self, what: str, n: int = 1) -> None:
        self.seen[what] = self.seen.get(what, 0) + n

    def touch(self, vblocks: list[list[Any]], oblocks: list[list[Any]]) -> None:
        """Touch each group's hits (0.11's touch takes them all at once, per group)."""
        if self.release == "0.11":
            self.v.touch(tuple(vblocks))
        else:
            for blocks in vblocks:
                self.v.touch(blocks)
        for blocks in oblocks:
            self.o.touch(blocks)

    def compare(self, where: str) -> None:
        v, o = self.v, self.o
        _expect("free-queue", o.free_block_ids(), [b.block_id for b in v.free_block_queue.get_all_free_blocks()],
                where)
        _expect("num-free", o.get_num_free_blocks(), v.get_num_free_blocks(), where)
        _expect("usage", o.get_usage(), v.get_usage(), where)
        _expect("ref-cnt", [b.ref_cnt for b in o.blocks[1:]], [b.ref_cnt for b in v.blocks[1:]], where)
        vh = [None if b.block_hash is None else (bytes(b.block_hash[:-4]), int.from_bytes(b.block_hash[-4:], "big"))
              for b in v.blocks]
        _expect("block-hash", [None if b.block_hash is None else (b.block_hash, b.group_id) for b in o.blocks],
                vh, where)
        cached: dict[tuple[bytes, int], list[int]] = {}
        for key, val in v.cached_block_hash_to_block._cache.items():
            ids = [val.block_id] if not isinstance(val, dict) else list(val)
            cached[(bytes(key[:-4]), int.from_bytes(key[-4:], "big"))] = ids
        _expect("cached-map", o.cached_blocks(), cached, where)
        if any(len(ids) > 1 for ids in cached.values()):
            self.saw("steps with duplicate copies")
        o.check_invariants()
        ev_v = _events_vllm(v.take_events(), self.release)
        ev_o = _events_ours(o.take_events(), self.release)
        _expect("events", ev_o, ev_v, where)
        for e in ev_v:
            self.saw({"S": "BlockStored", "R": "BlockRemoved", "C": "AllBlocksCleared"}[e[0]])
            if e[0] == "S" and (e[5] is not None or (len(e) > 7 and (any(e[8] or ()) or e[10]))):
                self.saw("BlockStored with lora/extra keys/session")
            if self.release == "0.33" and e[0] in "SR" and e[-2 if e[0] == "S" else -1] == 1:
                self.saw("events of group 1")


class Req:
    """One request on both sides: vLLM's request object and kvstream's hashes and blocks
    (one block list per KV cache group)."""

    def __init__(self, vreq: PeerRequest, ours: Any, groups: int) -> None:
        self.v = vreq
        self.ours = ours  # kvstream RequestBlockHasher
        self.tokens = list(vreq.all_token_ids)
        self.vblocks: list[list[Any]] = [[] for _ in range(groups)]
        self.oblocks: list[list[Any]] = [[] for _ in range(groups)]
        self.num_cached = 0
        self.lora_id: int | None = None
        self.lora_name: str | None = None
        self.session_id: str | None = None
        self.group = 0  # the group cache_blocks_of / announce_cached_prefix read blocks of

    # What kvstream's pool reads of a request (cache_blocks_of, announce_cached_prefix).
    @property
    def blocks(self) -> list[Any]:
        return self.oblocks[self.group]

    @property
    def block_hashes(self) -> list[bytes]:
        return self.ours.block_hashes

    @property
    def token_ids(self) -> list[int]:
        return self.tokens

    @property
    def extra_keys(self) -> Any:
        return self.ours.wire_extra_keys


def pool_case(vl: Any, release: str, seed: int, seen: dict[str, int]) -> int:
    """One random trace; returns the number of steps compared (coverage counts into ``seen``)."""
    rng = random.Random(seed)
    kcu = vl.kv_cache_utils
    os.environ["PYTHONHASHSEED"] = "diff"
    alg = "sha256_cbor" if rng.random() < 0.7 else "sha256"
    fn = getattr(vl.hashing, alg)
    kcu.init_none_hash(fn)
    num_blocks = rng.choice([2, 3, 4, 5, 6, 8, 12, 16, 32, 64, 256])
    bs = rng.choice([1, 2, 4, 4, 16])
    caching = rng.random() < 0.9
    events = rng.random() < 0.85
    int_hashes = rng.random() < 0.8
    G = 2 if rng.random() < 0.25 else 1
    gids = list(range(G))
    medium = "CPU" if release == "0.33" and rng.random() < 0.1 else "GPU"
    pair = PoolPair(vl, release, num_blocks, bs, caching, events, int_hashes, G, medium)
    vhasher = kcu.get_request_block_hasher(bs, fn)
    hit_heavy = rng.random() < 0.6
    vocab = 4 if hit_heavy else 5000
    families = [_tokens(rng, rng.randrange(0, bs * 4 + 1), vocab) for _ in range(rng.randrange(1, 4))]
    fancy = rng.random() < 0.4
    waiting: list[Req] = []
    running: list[Req] = []
    steps = rng.randrange(15, 70)
    rid = 0

    def new_request() -> Req:
        nonlocal rid
        rid += 1
        fam = rng.choice(families)
        shape = rng.random()
        if shape < 0.3:
            tail: list[int] = []
        elif shape < 0.5:
            tail = _tokens(rng, bs * rng.randrange(1, 3) - len(fam) % bs, vocab)
        else:
            tail = _tokens(rng, rng.randrange(0, bs * 3), vocab)
        prompt = fam + tail
        if not prompt:
            prompt = _tokens(rng, 1, vocab)
        lora = salt = session = None
        mm: list[tuple[str, int, int]] = []
        if fancy:
            if rng.random() < 0.4:
                lora = PeerLoRA(f"lora-{rng.randrange(2)}", rng.randrange(1, 3), "/p")
            if rng.random() < 0.3:
                salt = rng.choice(["", "s1", "s2"])
            if rng.random() < 0.3:
                mm = _mm_items(rng, len(prompt))
            if rng.random() < 0.5:
                session = f"sess-{rng.randrange(3)}"
        vreq = PeerRequest(rid, prompt, vhasher, lora=lora, salt=salt, session=session,
                           mm=[PeerMM(i, o, n) for i, o, n in mm])
        ours = _kv_request_hasher(release, alg, bs, lora, mm, salt, None)
        ours.extend(prompt)
        _expect("hash-prompt", ours.block_hashes, vreq.block_hashes, f"request {rid}")
        req = Req(vreq, ours, G)
        req.lora_id = lora.lora_int_id if lora else None
        req.lora_name = lora.lora_name if lora else None
        req.session_id = session
        return req

    def cache(req: Req, nc: int, nf: int) -> None:
        """vLLM's coordinator caches every group's newly full blocks, group by group."""
        if not caching:
            return  # vLLM's KVCacheManager.cache_blocks does not call the pool then
        for g in gids:
            pair.v.cache_full_blocks(req.v, req.vblocks[g], nc, nf, bs, g)
            if rng.random() < 0.5:
                req.group = g
                pair.o.cache_blocks_of(req, nc, nf, g)
            else:
                pair.o.cache_full_blocks(req.oblocks[g], req.ours.block_hashes, nc, nf, req.tokens, g,
                                         lora_id=req.lora_id, lora_name=req.lora_name,
                                         extra_keys=req.ours.wire_extra_keys, session_id=req.session_id)
        req.num_cached = nf

    def allocate(req: Req, need: int, where: str) -> None:
        for g in gids:
            vn = pair.v.get_new_blocks(need)
            on = pair.o.get_new_blocks(need)
            _expect("new-blocks", [b.block_id for b in on], [b.block_id for b in vn], f"{where} group {g}")
            req.vblocks[g] += vn
            req.oblocks[g] += on

    def free(req: Req, how: str) -> None:
        for g in gids:
            order = list(range(len(req.vblocks[g])))
            if how == "reverse":
                order.reverse()
            elif how == "shuffle":
                rng.shuffle(order)
            pair.v.free_blocks([req.vblocks[g][i] for i in order])
            pair.o.free_blocks([req.oblocks[g][i] for i in order])
        req.vblocks = [[] for _ in gids]
        req.oblocks = [[] for _ in gids]
        req.num_cached = 0

    def over_ask(where: str, n: int) -> None:
        errs = []
        for p in (pair.v, pair.o):
            try:
                got = p.get_new_blocks(n)
                errs.append(len(got))
            except ValueError:
                errs.append("ValueError")
        _expect("no-free-blocks", errs[1], errs[0], f"{where} get_new_blocks({n})")

    def admit(req: Req, where: str) -> bool:
        ntok = len(req.tokens)
        max_hit = (ntok - 1) // bs if caching else 0  # vLLM's manager skips the lookup then
        vh: list[list[Any]] = []
        for h in req.v.block_hashes[:max_hit]:
            got = pair.v.get_cached_block(h, gids)
            if not got:
                break
            vh.append(got)
        oh: list[list[Any]] = []
        for h in req.ours.block_hashes[:max_hit]:
            mine = pair.o.get_cached_block(h, gids)
            if not mine:
                break
            oh.append(mine)
        _expect("get-cached-block", [[b.block_id for b in x] for x in oh], [[b.block_id for b in x] for x in vh],
                where)
        if G == 1:
            pre = pair.o.cached_prefix(req.ours.block_hashes, max_hit)
            _expect("prefix-hit", [b.block_id for b in pre], [x[0].block_id for x in vh], where + " cached_prefix")
        pair.saw("prefix-hit blocks", len(vh) * G)
        nc = len(vh)
        vhits = [[x[g] for x in vh] for g in gids]
        ohits = [[x[g] for x in oh] for g in gids]
        need = -(-ntok // bs) - nc
        if need * G + sum(1 for x in vh for b in x if b.ref_cnt == 0) > pair.v.get_num_free_blocks():
            if rng.random() < 0.5:
                over_ask(where, pair.v.get_num_free_blocks() + rng.randrange(1, 3))
            return False
        if nc:
            pair.touch(vhits, ohits)
        req.vblocks, req.oblocks = vhits, ohits
        allocate(req, need, where)
        nf = ntok // bs
        if release == "0.33" and nc and rng.random() < 0.3:
            for g in gids:
                pair.v.emit_cached_block_events(req.v, nc, bs, g)
                req.group = g
                pair.o.announce_cached_prefix(req, nc, g)
            pair.saw("re-announced hits")
        if nf - nc >= 2 and rng.random() < 0.3:
            mid = rng.randrange(nc + 1, nf)
            cache(req, nc, mid)
            pair.saw("chunked caching (num_cached_blocks > 0)")
            pair.compare(where + " (first chunk)")
            cache(req, mid, nf)
        else:
            cache(req, nc, nf)
        req.num_cached = nf
        return True

    pair.compare("start")
    done = 0
    for step in range(steps):
        op = rng.random()
        where = f"step {step}"
        if op < 0.35 or not running:
            req = waiting.pop(0) if waiting and rng.random() < 0.5 else new_request()
            if admit(req, where + " admit"):
                running.append(req)
            else:
                waiting.append(req)
                if running and rng.random() < 0.5:  # preempt the newest: free it, requeue
                    victim = running.pop()
                    free(victim, "reverse")
                    waiting.append(victim)
        elif op < 0.75:
            req = rng.choice(running)
            k = 1 if rng.random() < 0.7 else rng.randrange(1, bs + 2)
            toks = _tokens(rng, k, vocab)
            total = len(req.tokens) + k
            need = -(-total // bs) - len(req.vblocks[0])
            if need * G > pair.v.get_num_free_blocks():
                running.remove(req)
                free(req, "reverse")
                waiting.append(req)
            else:
                req.v.append_output_token_ids(toks)
                req.ours.extend(toks)
                req.tokens += toks
                _expect("hash-decode", req.ours.block_hashes, req.v.block_hashes, where)
                if need > 0:
                    allocate(req, need, where + " decode")
                nf = total // bs
                if nf > req.num_cached:
                    cache(req, req.num_cached, nf)
        elif op < 0.93:
            req = running.pop(rng.randrange(len(running)))
            free(req, rng.choice(["reverse", "reverse", "reverse", "forward", "shuffle"]))
            # A finished request is gone; a later one may share its prefix.
        elif op < 0.97:
            if rng.random() < 0.5:  # everyone finishes first: the reset can succeed mid-trace
                for req in running:
                    free(req, "reverse")
                waiting.extend(running)
                running = []
            ok_v = pair.v.reset_prefix_cache()
            ok_o = pair.o.reset_prefix_cache()
            _expect("reset", ok_o, ok_v, where)
            pair.saw("resets " + ("done" if ok_v else "refused"))
        else:
            # Over-asking fails on both sides and changes nothing; asking for 0 gives [].
            over_ask(where, rng.choice([0, pair.v.get_num_free_blocks() + 1]))
        pair.compare(where)
        done += 1
    # Everyone finishes: the pool must be back to all free.
    for req in running:
        free(req, "reverse")
    pair.compare("drain")
    _expect("reset", pair.o.reset_prefix_cache(), pair.v.reset_prefix_cache(), "drain")
    pair.compare("after reset")
    for k, n in pair.seen.items():
        seen[k] = seen.get(k, 0) + n
    return done + 1


def manager_case(vl: Any, release: str, seed: int, seen: dict[str, int]) -> int:
    """One random trace through kvstream's ``KVCacheManager`` against vLLM's pool driven with
    the calls vLLM's ``KVCacheManager`` makes (as ``workloads.py`` models them): admission
    with the prefix lookup capped one token short of the prompt, the release's reservation
    rule (0.33: the whole prompt must fit; 0.11: the scheduled chunk), chunked prefill,
    decode token by token (a block cached as its last token is scheduled), preemption when
    a decode finds no free block, frees in reverse."""
    from kvstream.allocator import KVCacheManager
    from kvstream.compat import version
    from kvstream.hashing import LoRA, MMItem

    rng = random.Random(seed)
    kcu = vl.kv_cache_utils
    os.environ["PYTHONHASHSEED"] = "diff"
    alg = "sha256_cbor" if rng.random() < 0.7 else "sha256"
    fn = getattr(vl.hashing, alg)
    kcu.init_none_hash(fn)
    num_blocks = rng.choice([2, 3, 4, 6, 8, 16, 64])
    bs = rng.choice([1, 2, 4, 16])
    caching = rng.random() < 0.9
    pair = PoolPair(vl, release, num_blocks, bs, caching, True, True)
    rel = version(release)
    mgr = KVCacheManager(pair.o, rel.hasher(alg, bs), release=rel)
    reserve_full = mgr.reserve_full_prompt
    vhasher = kcu.get_request_block_hasher(bs, fn)
    vocab = rng.choice([3, 5000])
    families = [_tokens(rng, rng.randrange(0, bs * 4 + 1), vocab) for _ in range(rng.randrange(1, 4))]
    running: list[list[Any]] = []  # [vLLM request, vLLM blocks, num_cached, computed, kvstream request]
    waiting: list[list[Any]] = []
    rid = 0

    def v_cache(st: list[Any], total: int) -> None:
        nf = total // bs
        if caching and nf > st[2]:
            pair.v.cache_full_blocks(st[0], st[1], st[2], nf, bs, 0)
            st[2] = nf

    def v_admit(st: list[Any], chunk: int | None) -> bool:
        vreq = st[0]
        ntok = vreq.num_tokens
        hits: list[Any] = []
        if caching:
            for h in vreq.block_hashes[:(ntok - 1) // bs]:
                got = pair.v.get_cached_block(h, [0])
                if not got:
                    break
                hits.append(got[0])
        computed = len(hits) * bs
        total = ntok if chunk is None else computed + min(chunk, ntok - computed)
        reserve = ntok if reserve_full else total
        need = -(-reserve // bs) - len(hits)
        if need + sum(1 for b in hits if b.ref_cnt == 0) > pair.v.get_num_free_blocks():
            return False
        if hits:
            pair.touch([hits], [[]])  # kvstream's side touches inside admit()
        st[1] = hits + pair.v.get_new_blocks(-(-total // bs) - len(hits))
        st[2] = len(hits)
        st[3] = total
        v_cache(st, total)
        return True

    def v_free(st: list[Any]) -> None:
        pair.v.free_blocks(list(reversed(st[1])))
        st[1], st[2], st[3] = [], 0, 0

    def new() -> list[Any]:
        nonlocal rid
        rid += 1
        prompt = rng.choice(families) + _tokens(rng, rng.choice([0, bs, rng.randrange(1, bs * 3)]), vocab)
        if not prompt:
            prompt = [1]
        lora = salt = None
        mm: list[tuple[str, int, int]] = []
        if rng.random() < 0.3:
            lora = PeerLoRA("ad", 1, "/ad")
        if rng.random() < 0.3:
            salt = rng.choice(["", "s"])
        if rng.random() < 0.2:
            mm = _mm_items(rng, len(prompt))
        session = "sess" if release == "0.33" and rng.random() < 0.3 else None
        vreq = PeerRequest(rid, prompt, vhasher, lora=lora, salt=salt, session=session,
                           mm=[PeerMM(i, o, n) for i, o, n in mm])
        kreq = mgr.new_request(rid, prompt, lora=LoRA(lora.lora_name, lora.lora_path, lora.lora_int_id) if lora else None,
                               mm_items=[MMItem(i, o, n) for i, o, n in mm], cache_salt=salt, session_id=session)
        _expect("hash-prompt", kreq.block_hashes, vreq.block_hashes, f"request {rid}")
        return [vreq, [], 0, 0, kreq]

    def same_tables(st: list[Any], where: str) -> None:
        _expect("block-table", st[4].block_ids, [b.block_id for b in st[1]], where)
        _expect("computed-tokens", st[4].num_computed_tokens, st[3], where)

    pair.compare("start")
    steps = rng.randrange(20, 80)
    for step in range(steps):
        where = f"step {step}"
        op = rng.random()
        if op < 0.3 or not running:
            st = waiting.pop(0) if waiting and rng.random() < 0.5 else new()
            chunk = rng.randrange(1, bs * 2 + 1) if rng.random() < 0.3 else None
            # kvstream's admit checks num_new_tokens against what is left after its hits.
            ok_v = v_admit(st, chunk)
            left = st[4].num_tokens - len(mgr.get_computed_blocks(st[4])) * bs
            ok_o = mgr.admit(st[4], None if chunk is None else min(chunk, left))
            _expect("admit", ok_o, ok_v, where)
            pair.saw("admissions " + ("done" if ok_v else "refused"))
            if ok_v and st[4].num_prefix_hit_tokens:
                pair.saw("admissions with prefix hits")
            if ok_v and chunk is not None:
                pair.saw("chunked admissions")
            (running if ok_v else waiting).append(st)
            if ok_v:
                same_tables(st, where)
        elif op < 0.75:
            st = rng.choice(running)
            vreq, kreq = st[0], st[4]
            if st[3] < vreq.num_tokens:  # prefill left: the next chunk
                n = min(rng.randrange(1, bs * 2 + 1), vreq.num_tokens - st[3])
                total = st[3] + n
                need = -(-total // bs) - len(st[1])
                ok_v = need <= pair.v.get_num_free_blocks()
                if ok_v:
                    if need > 0:
                        st[1] += pair.v.get_new_blocks(need)
                    st[3] = total
                    v_cache(st, total)
                _expect("allocate", mgr.allocate(kreq, n), ok_v, where)
            else:
                tok = _tokens(rng, 1, vocab)[0]
                total = st[3] + 1
                need = -(-total // bs) - len(st[1])
                ok_v = need <= pair.v.get_num_free_blocks()
                if ok_v:
                    vreq.append_output_token_ids([tok])
                    if need > 0:
                        st[1] += pair.v.get_new_blocks(need)
                    st[3] = total
                    v_cache(st, total)
                _expect("decode", mgr.decode(kreq, tok), ok_v, where)
                if not ok_v:  # preempted for good (its next token is not kept by kvstream)
                    running.remove(st)
                    v_free(st)
                    mgr.free(kreq)
                    pair.saw("decodes refused (preempted)")
                else:
                    _expect("hash-decode", kreq.block_hashes, vreq.block_hashes, where)
            same_tables(st, where)
        elif op < 0.95:
            st = running.pop(rng.randrange(len(running)))
            v_free(st)
            mgr.free(st[4])
        else:
            if rng.random() < 0.5:
                for st in running:
                    v_free(st)
                    mgr.free(st[4])
                running = []
            _expect("reset", mgr.reset_prefix_cache(), pair.v.reset_prefix_cache(), where)
        pair.compare(where)
    for st in running:
        v_free(st)
        mgr.free(st[4])
    pair.compare("drain")
    if hasattr(kcu, "PrefixCachingMetrics"):
        # vLLM 0.11 keeps its hit-rate window here (0.33 moved it out of the files we load).
        from kvstream.allocator.prefix_stats import PrefixCacheStats, PrefixCachingMetrics

        window = rng.choice([1, 2, 5, 1000])
        theirs, ours = kcu.PrefixCachingMetrics(window), PrefixCachingMetrics(window)
        for i in range(rng.randrange(1, 40)):
            st = PrefixCacheStats(rng.choice([0, 1, 1, 3]), rng.randrange(0, 500), 0, rng.random() < 0.05)
            st.hits = rng.randrange(0, st.queries + 1)
            theirs.observe(st)
            ours.observe(st)
            _expect("prefix-metrics", (ours.aggregated_requests, ours.aggregated_query_total,
                                       ours.aggregated_query_hit, ours.hit_rate),
                    (theirs.aggregated_requests, theirs.aggregated_query_total,
                     theirs.aggregated_query_hit, theirs.hit_rate), f"window {window} observation {i}")
        pair.saw("hit-rate windows compared")
    for k, n in pair.seen.items():
        seen[k] = seen.get(k, 0) + n
    return steps + 1


def null_block_probe(vl: Any, release: str) -> list[str]:
    """Hand the null block to free_blocks and touch, as vLLM's sliding-window managers do."""
    notes = []
    pair = PoolPair(vl, release, 4, 4, True, True, True)
    for name in ("free_blocks", "touch"):
        vnull, onull = pair.v.null_block, pair.o.null_block
        try:
            if name == "touch":
                pair.touch([[vnull]], [[onull]])
            else:
                pair.v.free_blocks([vnull])
                pair.o.free_blocks([onull])
        except Exception as exc:
            notes.append(f"{name}([null block]): vLLM {release} accepts it (null ref_cnt {vnull.ref_cnt}); "
                         f"kvstream raises {type(exc).__name__}")
    if release == "0.33":
        # A sliding-window block table: the null block stands for a block out of the window;
        # 0.33's cache_full_blocks skips it (and leaves it out of the event).
        os.environ["PYTHONHASHSEED"] = "diff"
        vl.kv_cache_utils.init_none_hash(vl.hashing.sha256_cbor)
        req = PeerRequest("w", list(range(8)), vl.kv_cache_utils.get_request_block_hasher(4, vl.hashing.sha256_cbor))
        vb = [pair.v.null_block] + pair.v.get_new_blocks(1)
        ob = [pair.o.null_block] + pair.o.get_new_blocks(1)
        pair.v.cache_full_blocks(req, vb, 0, 2, 4, 0)
        try:
            pair.o.cache_full_blocks(ob, req.block_hashes, 0, 2, req.all_token_ids, 0)
        except Exception as exc:
            notes.append(f"cache_full_blocks([null, b], 0, 2): vLLM 0.33 caches b only; kvstream raises "
                         f"{type(exc).__name__}")
    return notes


# --------------------------------------------------------------------------------------
# Driver.


def worker(release: str, parts: list[str], cases: dict[str, int], seed0: int, verbose: bool,
           one: int | None) -> dict[str, Any]:
    from vllm_peer import shims

    vl = shims.load(fetch.source_root(release))
    mm_ok = _install_mm_window(vl, release)
    _install_tensor_data(vl)
    algorithms = ["sha256", "sha256_cbor"] + (["xxhash", "xxhash_cbor"] if release == "0.33" else [])
    out: dict[str, Any] = {"release": release, "mm_window": mm_ok, "parts": {}}
    saved_env = os.environ.get("PYTHONHASHSEED")
    for part in parts:
        seeds = [one] if one is not None else [seed0 + i for i in range(cases[part])]
        diffs: dict[str, list[str]] = {}
        seen: dict[str, int] = {}
        steps = 0
        t0 = time.perf_counter()
        for s in seeds:
            try:
                if part == "hash":
                    hash_case(vl, release, s, algorithms)
                    steps += 1
                elif part == "manager":
                    steps += manager_case(vl, release, s, seen)
                else:
                    steps += pool_case(vl, release, s, seen)
            except Diff as d:
                diffs.setdefault(d.category, []).append(f"seed {s}: {d.detail}")
            except Exception as exc:  # a crash on either side is a difference too
                tb = traceback.format_exc(limit=4) if verbose else ""
                diffs.setdefault("crash", []).append(f"seed {s}: {type(exc).__name__}: {exc} {tb}")
        out["parts"][part] = {"cases": len(seeds), "steps": steps, "seconds": time.perf_counter() - t0,
                              "seen": seen, "diffs": {k: (len(v), v[:3]) for k, v in diffs.items()}}
    if "pool" in parts:
        notes = null_block_probe(vl, release)
        if notes:
            out["parts"]["pool"]["diffs"]["null-block-refused"] = (len(notes), notes)
    if saved_env is None:
        os.environ.pop("PYTHONHASHSEED", None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", default=",".join(RELEASES), help="comma-separated: 0.11, 0.33")
    ap.add_argument("--part", default="pool,manager,hash", help="comma-separated: pool, manager, hash")
    ap.add_argument("--cases", type=int, help="seeded cases per part (default: pool 2000, manager 1000, hash 10000)")
    ap.add_argument("--seed", type=int, default=0, help="first case seed (cases use seed, seed+1, ...)")
    ap.add_argument("--one", type=int, help="run only the case with this seed (reproduce a difference)")
    ap.add_argument("-v", "--verbose", action="store_true", help="tracebacks for crashes")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts = args.part.split(",")
    cases = {p: args.cases if args.cases else DEFAULT_CASES[p] for p in DEFAULT_CASES}
    if args.worker:
        print(json.dumps(worker(args.worker, parts, cases, args.seed, args.verbose, args.one)))
        return
    failed = False
    t0 = time.perf_counter()
    for release in args.release.split(","):
        fetch.ensure(release)
        cmd = [sys.executable, __file__, "--worker", release, "--part", args.part, "--seed", str(args.seed)]
        if args.cases:
            cmd += ["--cases", str(args.cases)]
        if args.one is not None:
            cmd += ["--one", str(args.one)]
        if args.verbose:
            cmd += ["-v"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            raise SystemExit(f"worker for vLLM {release} failed")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"vLLM {release} vs kvstream (release={release!r}):")
        if not got["mm_window"]:
            print("  note: no cached wheel: 0.33's multimodal window search unavailable")
        for part, r in got["parts"].items():
            print(f"  {part:4s}: {r['cases']} cases, {r['steps']} steps compared, {r['seconds']:.1f} s")
            if r["seen"]:
                print("        exercised: " + ", ".join(f"{k} {n}" for k, n in sorted(r["seen"].items())))
            for cat, (n, examples) in sorted(r["diffs"].items()):
                known = cat in KNOWN
                failed |= not known
                print(f"    {'KNOWN ' if known else 'DIFF  '}{cat}: {n}")
                for e in examples:
                    print(f"      {e}")
            if not r["diffs"]:
                print("    no differences")
    print(f"total {time.perf_counter() - t0:.1f} s; {'DIFFERENCES FOUND' if failed else 'all equal (or known)'}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
