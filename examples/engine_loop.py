"""A toy engine loop embedding kvstream's allocator, with events published per step.

Run: ``python examples/engine_loop.py``

Six requests share a 48-token system prompt. The "engine" admits up to three at a time
(prefix hits come from the shared prompt), decodes one token per running request per
step, preempts the newest request when the pool runs out of blocks, and finishes a request
after a few tokens. Every step that changed the cache publishes one KVEventBatch; here the
sink is a list, in a real engine it is ``Publisher.publish`` (kvstream.transport).
"""

from __future__ import annotations

import anyio

from kvstream.allocator.shell import AsyncKVCacheManager
from kvstream.wire.events import BlockRemoved, BlockStored, KVEventBatch
from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool

BLOCK_SIZE = 16
SYSTEM = list(range(1000, 1048))  # 3 full blocks shared by every request


def summarize(batch: KVEventBatch) -> str:
    stored = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
    removed = sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
    return f"{len(batch.events)} events (+{stored} blocks stored, -{removed} removed)"


async def main() -> list[KVEventBatch]:
    pool = BlockPool(num_gpu_blocks=18, block_size=BLOCK_SIZE)  # 17 usable blocks
    manager = KVCacheManager(pool, BlockHasher("sha256_cbor", BLOCK_SIZE, seed="0"))
    published: list[KVEventBatch] = []
    waiting = [manager.new_request(f"req-{i}", SYSTEM + [2000 + 100 * i + t for t in range(20 + 7 * i)])
               for i in range(6)]
    running = []
    outputs = {r.request_id: 0 for r in waiting}
    step = 0
    async with AsyncKVCacheManager(manager, published.append) as kv:
        while waiting or running:
            # Schedule: admit while there is room for three requests.
            while waiting and len(running) < 3 and manager.admit(waiting[0]):
                req = waiting.pop(0)
                running.append(req)
                print(f"step {step:2d}: admit  {req.request_id} ({req.num_tokens} tokens, "
                      f"{req.num_prefix_hit_tokens} from the prefix cache)")
            # Run: one output token per running request; preempt when out of blocks.
            for req in list(running):
                if not req.running:  # preempted earlier in this step
                    continue
                while not manager.decode(req, 7000 + outputs[req.request_id]):
                    victim = running.pop()  # the newest request goes back to the queue
                    manager.free(victim)
                    waiting.insert(0, victim)
                    print(f"step {step:2d}: preempt {victim.request_id}")
                    if victim is req:
                        break
                else:
                    outputs[req.request_id] += 1
                    if outputs[req.request_id] == 24:
                        manager.free(req)
                        running.remove(req)
                        print(f"step {step:2d}: finish {req.request_id}")
            batch = await kv.step_done(ts=1_700_000_000.0 + step)
            if batch is not None and step % 8 == 0:
                print(f"step {step:2d}: published {summarize(batch)}")
            step += 1
    print(f"{step} steps, {len(published)} batches, {sum(len(b.events) for b in published)} events; "
          f"prefix-cache hit rate {manager.metrics.hit_rate:.0%}, usage now {manager.usage:.0%}")
    return published


if __name__ == "__main__":
    anyio.run(main)
