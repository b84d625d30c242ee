"""Block hashing throughput: vLLM-compatible algorithms and kvstream's native mode.

Run: ``.venv/bin/python bench/bench_hashing.py [--tokens 4096] [--block-size 16]``

Prints, for one prompt of ``--tokens`` random token ids (vocabulary 128k):
* the baseline (``cbor2.dumps(..., canonical=True)`` + ``hashlib.sha256`` per block, what
  vLLM's ``sha256_cbor`` does) against ``BlockHasher("sha256_cbor").hash_blocks``, and
  their ratio (target >= 1.5x, identical digests checked);
* tokens/s for every algorithm, including ``native``;
* the per-token cost of ``RequestBlockHasher.extend`` during decode.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import timeit

import cbor2

from kvstream.hashing import ALGORITHMS, BlockHasher, RequestBlockHasher


def baseline_sha256_cbor(tokens: list[int], block_size: int, root: bytes) -> list[bytes]:
    """The obvious implementation: one cbor2.dumps + hashlib.sha256 per full block."""
    out = []
    parent = root
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hashlib.sha256(
            cbor2.dumps((parent, tuple(tokens[i : i + block_size]), None), canonical=True)
        ).digest()
        out.append(parent)
    return out


def best_of(fn, number: int, repeat: int = 5) -> float:
    """Best mean seconds per call over ``repeat`` runs of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--number", type=int, default=200, help="calls per timing run")
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(args.tokens)]
    bs = args.block_size

    h = BlockHasher("sha256_cbor", bs, seed="0")
    assert h.hash_blocks(tokens) == baseline_sha256_cbor(tokens, bs, h.root), "fast path differs!"
    h.hash_blocks(tokens)  # warm the token-encoding cache, as a running server would be
    t_base = best_of(lambda: baseline_sha256_cbor(tokens, bs, h.root), args.number)
    t_ours = best_of(lambda: h.hash_blocks(tokens), args.number)
    print(f"sha256_cbor, {args.tokens} tokens, block {bs} ({args.tokens // bs} blocks), identical digests")
    print(f"  baseline cbor2.dumps + hashlib.sha256: {t_base * 1e6:8.1f} us")
    print(f"  kvstream BlockHasher.hash_blocks:      {t_ours * 1e6:8.1f} us")
    print(f"  speed-up: {t_base / t_ours:.2f}x (target >= 1.5x)")
    print()
    print(f"{'algorithm':<12} {'us/prompt':>10} {'M tokens/s':>11}  vLLM-compatible")
    for name in ALGORITHMS:
        hasher = BlockHasher(name, bs, seed="0")
        hasher.hash_blocks(tokens)
        t = best_of(lambda: hasher.hash_blocks(tokens), args.number)
        print(f"{name:<12} {t * 1e6:10.1f} {args.tokens / t / 1e6:11.1f}  {hasher.vllm_compatible}")
    print()
    decode = 16 * 256
    for name in ("sha256_cbor", "native"):
        hasher = BlockHasher(name, bs, seed="0")

        def run() -> None:
            r = RequestBlockHasher(hasher)
            r.extend(tokens)
            for t in range(decode):
                r.extend((t,))

        t_total = best_of(run, 10, 3) - best_of(lambda: RequestBlockHasher(hasher).extend(tokens), 50, 3)
        print(
            f"RequestBlockHasher.extend, 1 token per call ({name}): "
            f"{t_total / decode * 1e9:.0f} ns/token incl. a block hash every {bs} tokens"
        )


if __name__ == "__main__":
    main()
