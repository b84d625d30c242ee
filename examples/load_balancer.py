"""A small prefix-aware load balancer: N simulated engines publish KV events over ZMQ, a
kvstream Router follows them, and each incoming prompt goes to the engine the Router picks.

    .venv/bin/python examples/load_balancer.py [--engines 3] [--requests 60]

Each engine is a kvstream BlockPool + KVCacheManager (vLLM's allocator) behind a real
Publisher on an ipc:// socket. Prompts are conversations that share system prompts, so
routing by cached prefix pays: the script prints each choice, then the prefix-cache hit
rate it got, next to what round-robin gets on the same prompts.

Load is what the balancer itself knows: requests arrive every ARRIVAL_S seconds, and an
engine is busy with each for SERVICE_S seconds plus its uncached prompt tokens at
PREFILL_TOK_S; the requests an engine has not finished are its queue. The router weighs a
waiting request against the cached share of the prompt (``QUEUE_WEIGHT``), so a popular
prefix spills onto idle engines instead of piling up on one.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile

import anyio

from kvstream.wire.events import KVEventBatch
from kvstream.allocator.manager import KVCacheManager
from kvstream.allocator.pool import BlockPool
from kvstream.routing.router import Router
from kvstream.routing.scoring import Load, PrefixLoadPolicy
from kvstream.transport import KVEventsConfig, Publisher, SourceSpec

BLOCK = 16
ARRIVAL_S = 0.005  # seconds between requests
SERVICE_S = 0.03  # seconds per request, plus prefill
PREFILL_TOK_S = 4000.0  # uncached prompt tokens per second
QUEUE_WEIGHT = 0.25  # score lost per waiting request (a full-prompt hit scores 1.0)


class Engine:
    """An allocator that runs requests to completion at once (admit, then free)."""

    def __init__(self, name: str, blocks: int) -> None:
        self.name = name
        self.mgr = KVCacheManager(BlockPool(blocks, BLOCK))
        self.n = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.finish: list[float] = []  # when each accepted request is done (seconds)

    def queue(self, now: float) -> int:
        """Requests not finished at ``now``."""
        self.finish = [t for t in self.finish if t > now]
        return len(self.finish)

    def serve(self, prompt: list[int], now: float = 0.0) -> list:
        self.n += 1
        req = self.mgr.new_request(f"{self.name}-{self.n}", prompt)
        hit = len(self.mgr.get_computed_blocks(req)) * BLOCK
        if self.mgr.admit(req):
            self.hit_tokens += hit
            self.mgr.free(req)
        self.prompt_tokens += len(prompt)
        start = max([now] + self.finish)
        self.finish.append(start + SERVICE_S + (len(prompt) - hit) / PREFILL_TOK_S)
        return self.mgr.take_events()


def workload(n: int, seed: int = 7) -> list[list[int]]:
    rnd = random.Random(seed)
    systems = [[10_000 * s + i for i in range(rnd.choice((64, 96, 128)))] for s in range(6)]
    convs: list[list[int]] = []
    out = []
    for _ in range(n):
        if convs and rnd.random() < 0.5:
            c = rnd.randrange(len(convs))  # a follow-up turn of an earlier conversation
            convs[c] = convs[c] + [rnd.randrange(30_000) for _ in range(rnd.randrange(16, 48))]
            out.append(convs[c])
        else:
            convs.append(list(rnd.choice(systems)) + [rnd.randrange(30_000) for _ in range(rnd.randrange(8, 40))])
            out.append(convs[-1])
    return out


async def run(n_engines: int, n_requests: int, verbose: bool = True) -> dict[str, float]:
    prompts = workload(n_requests)
    with tempfile.TemporaryDirectory() as tmp:
        engines = [Engine(f"engine-{i}", 64) for i in range(n_engines)]
        async with contextlib.AsyncExitStack() as stack:
            pubs: list[Publisher] = []
            for i in range(n_engines):
                cfg = KVEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp}/e{i}.sock",
                                     replay_endpoint=f"ipc://{tmp}/e{i}-replay.sock")
                pubs.append(await stack.enter_async_context(Publisher(cfg)))
            specs = [SourceSpec(p.endpoint, p.replay_endpoint, name=e.name) for p, e in zip(pubs, engines)]
            seqs = [-1] * n_engines
            policy = PrefixLoadPolicy(queue_weight=QUEUE_WEIGHT)
            router = await stack.enter_async_context(Router(specs, speculative_ttl_s=1.0, policy=policy))
            for k, prompt in enumerate(prompts):
                now = k * ARRIVAL_S
                loads = {e.name: Load(queue=e.queue(now), kv_usage=e.mgr.usage) for e in engines}
                res = router.route(prompt, loads)
                i = int(res.best.rsplit("-", 1)[1])  # type: ignore[union-attr]
                events = engines[i].serve(prompt, now)
                if events:
                    pubs[i].publish(KVEventBatch(float(k), events))
                    seqs[i] += 1
                    await router.wait_applied(engines[i].name, seqs[i])
                if verbose:
                    m = res.matches[res.best]  # type: ignore[index]
                    print(f"request {k:3d} ({len(prompt):3d} tokens) -> {res.best}  "
                          f"cached prefix {m.tokens:3d} tokens")
    routed = sum(e.hit_tokens for e in engines) / sum(e.prompt_tokens for e in engines)
    # The same prompts, round-robin, on fresh engines.
    rr = [Engine(f"rr-{i}", 64) for i in range(n_engines)]
    for k, prompt in enumerate(prompts):
        rr[k % n_engines].serve(prompt)
    robin = sum(e.hit_tokens for e in rr) / sum(e.prompt_tokens for e in rr)
    spread = {e.name: e.n for e in engines}
    if verbose:
        print(f"\nprefix-cache hit rate: routed {routed:.1%}, round-robin {robin:.1%}; "
              f"requests per engine: {spread}")
    return {"routed": routed, "round_robin": robin}


def _at_least_one(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=_at_least_one, default=3, help="simulated engines (default 3)")
    ap.add_argument("--requests", type=_at_least_one, default=60, help="prompts to route (default 60)")
    a = ap.parse_args()
    anyio.run(run, a.engines, a.requests)


if __name__ == "__main__":
    main()
