"""Block hashing: kvstream against the naive loop and vLLM's own hasher, on unseen prompts.

Run: ``.venv/bin/python bench/bench_hashing.py [--prompts 30] [--rounds 3] [--tokens 512,4096,8192]
[--short-only] [--keys-only]``

Inputs (``bench/vllm_peer/workloads.py``): prompts of each ``--tokens`` length over a 128k vocabulary,
``uniform`` (ids uniform, a new prompt every call: what a router mostly sees), ``zipf``
(low ids frequent, new every call) and ``repeated`` (one prompt over and over).

For every vLLM algorithm it prints microseconds per prompt for

* the naive loop: one ``serialize((parent, tuple(block), None))`` + digest per block
  (``cbor2.dumps(..., canonical=True)`` or ``pickle.dumps``; sha256 or xxh3_128), which is
  what vLLM's ``hash_block_tokens`` does;
* vLLM 0.33's own request hasher (``get_request_block_hasher`` from its unmodified
  ``kv_cache_utils.py``) when the peer cache holds it (``bench/vllm_peer/fetch.py``);
* kvstream's ``RequestBlockHasher.extend`` (the prompt in one call into the native core),
  and the ratio.

and the same with 256 output tokens appended one call each (the incremental hasher:
``RequestBlockHasher.appender()`` for kvstream, ``append_output_token`` for vLLM), and
a floor: the digest calls alone on the naive loop's own serialized inputs (same lengths),
which no hasher of that algorithm can beat.
Digests are checked equal. Every prompt is timed alone, contenders alternate prompt by
prompt, and the median per-prompt time counts (robust to bursts of load on a shared machine).
Target (issue #25): >= 4x the naive loop for every vLLM algorithm on unseen prompts.

A router-keys section (alone with ``--keys-only``) times ``kvstream.routing.keys`` on fresh
uniform prompts: ``prompt_keys`` of a token list, of a packed ``array('I')``, and
``chain_keys`` of packed bytes, against the pure-Python loop it replaced (one
``xxhash.xxh3_64_intdigest`` call per router block) in the same run, in M tokens/s.
Target (issue #25): >= 300 M tokens/s.

A last section (alone with ``--short-only``) times short prompts (0 to 400 tokens) and
256 per-token decode calls after them: the naive loop, kvstream's request hasher and its
one-shot ``hash_blocks``/``hash_block``, in one run (goal: never slower than the naive loop).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pickle
import statistics
import sys
import time
from array import array
from typing import Any, Callable

import cbor2
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_peer import fetch, workloads  # noqa: E402

from kvstream.hashing import VLLM_ALGORITHMS, BlockHasher, RequestBlockHasher  # noqa: E402
from kvstream.routing.keys import KEY_MASK, chain_keys, namespace, prompt_keys  # noqa: E402

BS = workloads.BLOCK_SIZE
DECODE = [t % 1000 + 1000 for t in range(256)]
MODES = ("prompt", "+decode")


def naive_hasher(algorithm: str) -> Callable[[Any], bytes]:
    """The obvious hash function: serialize the tuple, digest it."""
    ser: Callable[[Any], bytes] = (
        (lambda o: cbor2.dumps(o, canonical=True)) if algorithm.endswith("_cbor")
        else (lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)))
    if algorithm.startswith("sha256"):
        return lambda o: hashlib.sha256(ser(o)).digest()
    return lambda o: xxhash.xxh3_128_digest(ser(o))


def naive_hasher_ser(algorithm: str) -> Callable[[Any], bytes]:
    """The naive loop's serializer alone (for the floor: digests of the same inputs)."""
    if algorithm.endswith("_cbor"):
        return lambda o: cbor2.dumps(o, canonical=True)
    return lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)


def _naive_inputs(ser: Callable[[Any], bytes], tokens: list[int], root: bytes, size: int, decode: bool) -> list[bytes]:
    """Every block's serialized input as the naive loop chains them (parents of the
    algorithm's digest size; only the input lengths matter for the floor)."""
    toks = list(tokens) + (DECODE if decode else [])
    out, parent = [], root
    for i in range(0, len(toks) - len(toks) % BS, BS):
        b = ser((parent, tuple(toks[i : i + BS]), None))
        out.append(b)
        parent = hashlib.sha256(b).digest()[:size]
    return out


def naive_blocks(fn: Callable[[Any], bytes], tokens: list[int], parent: bytes) -> list[bytes]:
    out = []
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = fn((parent, tuple(tokens[i : i + BS]), None))
        out.append(parent)
    return out


def naive_contenders(
    naive: Callable[[Any], bytes], root: bytes
) -> tuple[Callable[[list[int]], list[bytes]], Callable[[list[int]], list[bytes]]]:
    """The naive loop's two contenders: a prompt, and a prompt followed by the ``DECODE``
    tokens appended one at a time (a block hashed inline whenever one fills)."""

    def naive_prompt(p: list[int]) -> list[bytes]:
        return naive_blocks(naive, p, root)

    def naive_decode(p: list[int]) -> list[bytes]:
        toks = list(p)
        hs = naive_blocks(naive, toks, root)
        for t in DECODE:
            toks.append(t)
            if len(toks) % BS == 0:
                hs.append(naive((hs[-1] if hs else root, tuple(toks[-BS:]), None)))
        return hs

    return naive_prompt, naive_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=30, help="prompts per input kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithms", default=",".join(VLLM_ALGORITHMS))
    ap.add_argument("--tokens", default="512,4096,8192", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--short-samples", type=int, default=15, help="batches per cell in the short-prompt section")
    ap.add_argument("--short-only", action="store_true", help="only the short-prompt and decode section")
    ap.add_argument("--keys-only", action="store_true", help="only the router-keys section")
    args = ap.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    if args.short_only:
        short_section(args.algorithms.split(","), args.short_samples)
        return
    if args.keys_only:
        keys_section(lengths, args.prompts, args.rounds)
        return
    vl = None
    if fetch.available("0.33"):
        from vllm_peer import shims

        vl = shims.load(fetch.source_root("0.33"))
    else:
        print("(vLLM 0.33 is not in the peer cache: run bench/vllm_peer/fetch.py once to compare with it)")
    for length in lengths:
        print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; us per {length:,}-token prompt, "
              f"median of {args.rounds} rounds x {args.prompts} prompts, each timed alone")
        for algorithm in args.algorithms.split(","):
            algorithm_section(algorithm, length, args, vl)
    keys_section(lengths, args.prompts, args.rounds)
    short_section(args.algorithms.split(","), args.short_samples)


def algorithm_section(algorithm: str, length: int, args: argparse.Namespace, vl: Any) -> None:
    """One algorithm at one prompt length: every contender, every input kind, the floor."""
    hasher = BlockHasher(algorithm, BS, seed="bench")
    root = hasher.root
    naive = naive_hasher(algorithm)
    contenders: dict[str, tuple[Callable[[list[int]], list[bytes]], Callable[[list[int]], list[bytes]]]] = {}

    naive_prompt, naive_decode = naive_contenders(naive, root)

    contenders["naive loop"] = (naive_prompt, naive_decode)
    if vl is not None:
        kcu = vl.kv_cache_utils
        fn = getattr(vl.hashing, algorithm)
        os.environ["PYTHONHASHSEED"] = "bench"
        kcu.init_none_hash(fn)
        if kcu.NONE_HASH == root:  # xxhash roots are random per process in vLLM: skip those
            vh = kcu.get_request_block_hasher(BS, fn)

            def vllm_prompt(p: list[int], vh: Any = vh) -> list[bytes]:
                return workloads.PeerRequest(0, list(p), None, vh).block_hashes

            def vllm_decode(p: list[int], vh: Any = vh) -> list[bytes]:
                req = workloads.PeerRequest(0, list(p), None, vh)
                for t in DECODE:
                    req.append_output_token(t)
                return req.block_hashes

            contenders["vLLM 0.33 hasher"] = (vllm_prompt, vllm_decode)

    def ours_prompt(p: list[int]) -> list[bytes]:
        return RequestBlockHasher(hasher).extend(p)

    def ours_decode(p: list[int]) -> list[bytes]:
        r = RequestBlockHasher(hasher)
        r.extend(p)
        append = r.appender()  # the request's decode-token sink: a C-level list append
        for t in DECODE:
            append(t)  # one call a token, like the others; blocks hashed when read
        return r.block_hashes

    contenders["kvstream"] = (ours_prompt, ours_decode)
    samples: dict[tuple[str, str], list[float]] = {}
    names = list(contenders)
    for kind in workloads.HASH_KINDS:
        check = workloads.hash_prompts(kind, 1, length, seed=99)[0]
        want = naive_decode(check)
        for name, (_, dec) in contenders.items():
            assert dec(check) == want, f"{name} differs from the naive loop ({algorithm}, {kind})"
        for r in range(args.rounds):
            # Fresh prompts for every contender, mode and round: never seen before.
            batches = {
                (name, mode): workloads.hash_prompts(
                    kind, args.prompts, length, seed=1000 * r + hash((name, mode)) % 997)
                for name in names for mode in MODES
            }
            gc.collect()
            gc.disable()
            for i in range(args.prompts):
                # Contenders alternate prompt by prompt (order flipped every prompt), so
                # a burst of load from other processes hits them alike.
                for name in names if i % 2 == 0 else names[::-1]:
                    for mode, fn in zip(MODES, contenders[name]):
                        p = batches[(name, mode)][i]
                        t0 = time.perf_counter()
                        fn(p)
                        dt = (time.perf_counter() - t0) * 1e6
                        samples.setdefault((name, f"{kind} {mode}"), []).append(dt)
            gc.enable()
    # The floor: the digest calls alone, on the naive loop's own inputs (same lengths),
    # with the serialization done beforehand. No hasher of these algorithms can go below it.
    digest_only = xxhash.xxh3_128_digest if algorithm.startswith("xxhash") else (
        lambda b: hashlib.sha256(b).digest())
    for kind in workloads.HASH_KINDS:
        for mode in MODES:
            for p in workloads.hash_prompts(kind, args.prompts, length, seed=4242):
                inputs = _naive_inputs(naive_hasher_ser(algorithm), p, root, hasher.digest_size, mode == "+decode")
                t0 = time.perf_counter()
                for b in inputs:
                    digest_only(b)
                samples.setdefault(("floor", f"{kind} {mode}"), []).append((time.perf_counter() - t0) * 1e6)
    best = {key: statistics.median(v) for key, v in samples.items()}
    cols = [f"{k} {m}" for k in workloads.HASH_KINDS for m in ("prompt", "+decode")]
    print(f"\n{algorithm}, {length:,} tokens")
    print(f"  {'':22s}" + "".join(f"{c:>18s}" for c in cols))
    for name in [*contenders, "floor"]:
        label = "floor (digests only)" if name == "floor" else name
        print(f"  {label:22s}" + "".join(f"{best[(name, c)]:18.1f}" for c in cols))
    for ref in contenders:
        if ref != "kvstream":
            print(f"  {'x ' + ref:22s}" + "".join(f"{best[(ref, c)] / best[('kvstream', c)]:17.2f}x" for c in cols))


def _python_chain_keys(raw: bytes, n_blocks: int, R: int, seed: int) -> list[int]:
    """The pure-Python loop the native core replaced: one xxh3_64 call per router block."""
    h, mask, step, k, keys = xxhash.xxh3_64_intdigest, KEY_MASK, 4 * R, seed, [0] * n_blocks
    off = 0
    for i in range(n_blocks):
        end = off + step
        keys[i] = k = h(raw[off:end], k) & mask
        off = end
    return keys


def keys_section(lengths: list[int], prompts: int, rounds: int) -> None:
    """Router keys of fresh uniform prompts: kvstream against the Python loop, M tokens/s."""
    R = BS
    print(f"\nrouter keys (block {R}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}): "
          f"M tokens/s, median of {rounds} rounds x {prompts} fresh prompts (higher is better)")
    print(f"  {'tokens':>6s} {'prompt_keys(list)':>18s} {'prompt_keys(array)':>19s} {'chain_keys(bytes)':>18s}"
          f" {'Python: array + loop':>21s} {'Python loop(bytes)':>19s} {'x list':>7s} {'x bytes':>8s}")
    ns = namespace()
    for length in lengths:
        n = length // R
        check = workloads.hash_prompts("uniform", 1, length, seed=17)[0]
        want = _python_chain_keys(array("I", check).tobytes(), n, R, ns)
        assert prompt_keys(check, R) == prompt_keys(array("I", check), R) == want, "router keys differ"
        assert chain_keys(array("I", check).tobytes(), n, R, ns) == want
        contenders: dict[str, Callable[[Any], Any]] = {
            "list": lambda p: prompt_keys(p, R),
            "array": lambda p: prompt_keys(p, R),
            "bytes": lambda p: chain_keys(p, n, R, ns),
            "py list": lambda p: _python_chain_keys(array("I", p).tobytes(), n, R, ns),
            "py bytes": lambda p: _python_chain_keys(p, n, R, ns),
        }
        forms: dict[str, Callable[[list[int]], Any]] = {
            "list": lambda p: p, "array": lambda p: array("I", p), "bytes": lambda p: array("I", p).tobytes(),
            "py list": lambda p: p, "py bytes": lambda p: array("I", p).tobytes(),
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for r in range(rounds):
            batches = {k: [forms[k](p) for p in workloads.hash_prompts("uniform", prompts, length, seed=5000 + 31 * r + i)]
                       for i, k in enumerate(names)}
            gc.collect()
            gc.disable()
            for i in range(prompts):
                for k in names if i % 2 == 0 else names[::-1]:
                    p = batches[k][i]
                    t0 = time.perf_counter()
                    contenders[k](p)
                    times[k].append(time.perf_counter() - t0)
            gc.enable()
        rate = {k: length / statistics.median(v) / 1e6 for k, v in times.items()}
        print(f"  {length:6d} {rate['list']:18.1f} {rate['array']:19.1f} {rate['bytes']:18.1f}"
              f" {rate['py list']:21.1f} {rate['py bytes']:19.1f} {rate['list'] / rate['py list']:6.2f}x"
              f" {rate['bytes'] / rate['py bytes']:7.2f}x")


SHORT_LENGTHS = (0, 1, 15, 16, 17, 21, 32, 53, 100, 181, 400)


def short_section(algorithms: list[str], samples_per: int) -> None:
    """kvstream's request hasher against the naive loop on short prompts and decode steps.

    For each prompt length: a new request per prompt (``RequestBlockHasher(h).extend(p)``)
    against ``naive_blocks``; and the same prompt followed by the 256 output tokens of
    ``DECODE``, one call each of the request's ``appender()`` (and, for reference, one
    ``extend((t,))`` call each), against the naive loop's inline append.
    Each sample times a batch of fresh uniform prompts (short prompts are too quick to time
    one by one); the contenders alternate batch by batch; the median sample counts.
    """
    import random

    print(f"\nshort prompts and decode steps (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}): "
          f"kvstream / naive loop, us per request, median of {samples_per} batches, x = naive / kvstream")
    rng = random.Random(5)
    for algorithm in algorithms:
        hasher = BlockHasher(algorithm, BS, seed="bench")
        root = hasher.root
        naive = naive_hasher(algorithm)

        naive_prompt, naive_decode = naive_contenders(naive, root)

        def ours_prompt(p: list[int]) -> list[bytes]:
            return RequestBlockHasher(hasher).extend(p)

        def ours_decode(p: list[int]) -> list[bytes]:
            r = RequestBlockHasher(hasher)
            r.extend(p)
            append = r.appender()
            for t in DECODE:
                append(t)
            return r.block_hashes

        def extend_decode(p: list[int]) -> list[bytes]:
            # The same through extend((t,)): a Python method call a token (shown for reference).
            r = RequestBlockHasher(hasher)
            r.extend(p)
            for t in DECODE:
                r.extend((t,))
            return r.block_hashes

        def oneshot_prompt(p: list[int]) -> list[bytes]:
            return hasher.hash_blocks(p)

        def oneshot_decode(p: list[int]) -> list[bytes]:
            # The caller keeps the tokens (an engine's request does) and hashes a block when
            # one fills: the naive loop's shape with kvstream's one-block call.
            toks = list(p)
            hs = hasher.hash_blocks(toks)
            for t in DECODE:
                toks.append(t)
                if len(toks) % BS == 0:
                    hs.append(hasher.hash_block(hs[-1] if hs else None, toks[-BS:]))
            return hs

        pairs = {"prompt": (naive_prompt, ours_prompt, oneshot_prompt, None),
                 "+decode": (naive_decode, ours_decode, oneshot_decode, extend_decode)}
        cells = []
        for n in SHORT_LENGTHS:
            batch = 100 if n < 64 else 20
            for mode, (nf, of, sf, ef) in pairs.items():
                check = [rng.randrange(workloads.VOCAB) for _ in range(n)]
                want = nf(check)
                assert of(check) == want and sf(check) == want and (ef is None or ef(check) == want), \
                    f"kvstream differs from the naive loop ({algorithm}, {n}, {mode})"
                times: dict[str, list[float]] = {"naive": [], "ours": [], "oneshot": [], "extend": []}
                gc.collect()
                gc.disable()
                contenders = [("naive", nf), ("ours", of), ("oneshot", sf)] + ([("extend", ef)] if ef else [])
                for i in range(samples_per):
                    # Contenders alternate batch by batch (order rotated every batch).
                    k = i % len(contenders)
                    order = contenders[k:] + contenders[:k]
                    for name, f in order:
                        ps = [[rng.randrange(workloads.VOCAB) for _ in range(n)] for _ in range(batch)]
                        t0 = time.perf_counter()
                        for p in ps:
                            f(p)
                        times[name].append((time.perf_counter() - t0) / batch * 1e6)
                gc.enable()
                med = {k: statistics.median(v) for k, v in times.items() if v}
                cells.append((n, mode, med["ours"], med["oneshot"], med["naive"], med.get("extend", 0.0)))
        print(f"\n{algorithm}: RequestBlockHasher (request) and hash_blocks/hash_block (one-shot) against the naive loop")
        print(f"  {'tokens':>6s}  {'prompt us: request / one-shot / naive':>37s} {'x req':>6s} {'x one':>6s}"
              f"   {'+256 decode us: appender / one-shot / naive':>42s} {'x app':>6s} {'x one':>6s}"
              f"   {'extend((t,)) us':>15s} {'x ext':>6s}")
        for n in SHORT_LENGTHS:
            (_, _, o1, s1, v1, _), (_, _, o2, s2, v2, e2) = [c for c in cells if c[0] == n]
            print(f"  {n:6d}  {o1:13.2f} / {s1:8.2f} / {v1:8.2f} {v1 / o1:5.2f}x {v1 / s1:5.2f}x"
                  f"   {o2:20.1f} / {s2:7.1f} / {v2:7.1f} {v2 / o2:5.2f}x {v2 / s2:5.2f}x"
                  f"   {e2:15.1f} {v2 / e2:5.2f}x")
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
