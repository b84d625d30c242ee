"""A real engine for the JetStream tests: kvstream's allocator (pool + manager) serving a
small multi-turn workload, its events published per step by kvstream's ZMQ Publisher."""

from __future__ import annotations

import random
import time
from typing import Any

from kvstream.wire.events import KVEventBatch, encode_batch
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.transport import KVEventsConfig, Publisher, SourceSpec

BS = 16


class Engine:
    """Publishes one batch per :meth:`step` (admit a request sharing a prefix, free old ones)."""

    def __init__(self, tmp_path: Any, name: str, *, seed: int = 0, blocks: int = 256,
                 buffer_steps: int = 10_000, clock_offset_s: float = 0.0) -> None:
        self.name = name
        self.cfg = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp_path}/{name}.sock",
                                  replay_endpoint=f"ipc://{tmp_path}/{name}-replay.sock",
                                  buffer_steps=buffer_steps, topic=f"kv@{name}")
        self.rng = random.Random(seed)
        self.manager = KVCacheManager(BlockPool(num_gpu_blocks=blocks, block_size=BS),
                                      BlockHasher("sha256_cbor", BS, seed="0"))
        self.prefixes = [[1000 * p + t for t in range(BS * 4)] for p in range(8)]
        self.running: list[Any] = []
        self.payloads: list[bytes] = []
        """Every payload published, by seq (the bytes on the wire)."""
        self.n = 0
        self.pub: Publisher | None = None
        self.clock_offset_s = clock_offset_s
        """Seconds this engine's clock is ahead of (or, negative, behind) the machine's."""
        self.ts = time.time() + clock_offset_s

    @property
    def spec(self) -> SourceSpec:
        return SourceSpec(self.cfg.endpoint, self.cfg.replay_endpoint, name=self.name)

    async def __aenter__(self) -> "Engine":
        self.pub = Publisher(self.cfg)
        await self.pub.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        pub, self.pub = self.pub, None
        if pub is not None:
            await pub.__aexit__(None, None, None)

    def step(self) -> int:
        """Run one scheduler step and publish its events (one batch); returns its seq."""
        m = self.manager
        self.n += 1
        prompt = self.rng.choice(self.prefixes) + [self.rng.randrange(50_000) for _ in range(BS * 3 + 5)]
        req = m.new_request(f"{self.name}-{self.n}", prompt)
        while not m.admit(req) and self.running:
            m.free(self.running.pop(0))
        if req.running:
            self.running.append(req)
        while len(self.running) > 4:
            m.free(self.running.pop(0))
        events = m.take_events()
        self.ts = max(self.ts + 1e-6, time.time() + self.clock_offset_s)  # wall clock, as vLLM stamps batches
        assert self.pub is not None
        payload = encode_batch(KVEventBatch(self.ts, events))
        seq = len(self.payloads)
        self.payloads.append(payload)
        self.pub.publish_raw(payload, seq)
        return seq

    def steps(self, n: int) -> list[int]:
        return [self.step() for _ in range(n)]
