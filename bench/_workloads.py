"""Workloads shared by the benchmarks (not a test fixture: benches only)."""

from __future__ import annotations

import random
import time
from array import array
from typing import Any

from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.hashing import BlockHasher
from kvstream.wire.events import KVEventBatch, encode_batch

BS = 16
"""Tokens per block of every workload here."""


def allocator_batches(n: int, seed: int = 0, algorithm: str = "xxhash") -> list[bytes]:
    """``n`` consecutive encoded batches of one engine: kvstream's allocator (8,192 blocks)
    serving requests that share 32 system prompts (4 blocks) plus 3-5 blocks of their own,
    up to 8 running; block hashes by ``algorithm``."""
    rng = random.Random(seed)
    m = KVCacheManager(BlockPool(num_gpu_blocks=8192, block_size=BS), BlockHasher(algorithm, BS, seed="0"))
    prefixes = [list(range(100_000 * p, 100_000 * p + 4 * BS)) for p in range(32)]
    running: list[Any] = []
    out = []
    ts = time.time()
    for i in range(n):
        own = array("H", rng.randbytes(2 * BS * rng.randint(3, 5) + 6)).tolist()
        req = m.new_request(i, rng.choice(prefixes) + own)
        while not m.admit(req) and running:
            m.free(running.pop(0))
        if req.running:
            running.append(req)
        while len(running) > 8:
            m.free(running.pop(0))
        ts += 0.0005
        out.append(encode_batch(KVEventBatch(ts, m.take_events())))
    return out
