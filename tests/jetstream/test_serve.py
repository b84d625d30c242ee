"""Router replicas behind a load balancer: three ``kvstream serve`` processes reading one
JetStream stream answer every ``/v1/route`` identically."""

from __future__ import annotations

import anyio
import httpx

from kvstream.jetstream import Relay

from ..service.conftest import ServeProc
from .engines import Engine


async def _fill(tmp_path, url: str, engines: list[Engine], n: int) -> None:
    async with Relay([e.spec for e in engines], url) as relay, anyio.create_task_group() as tg:
        tg.start_soon(relay.run)
        for e in engines:
            e.steps(n)
        with anyio.fail_after(60):
            while any(relay.sources[e.name].pos < n - 1 for e in engines) or relay.stats.inflight:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()


def test_three_serve_replicas_on_one_stream_route_identically(tmp_path, nats_server) -> None:
    async def fill() -> list[Engine]:
        async with Engine(tmp_path, "e0", seed=7) as e0, Engine(tmp_path, "e1", seed=8) as e1:
            await _fill(tmp_path, nats_server.url, [e0, e1], 60)
        return [e0, e1]

    e0, e1 = anyio.run(fill)
    url = nats_server.url + "/KV_EVENTS"
    replicas = [ServeProc(f"e0={url}", f"e1={url}", "--load-interval", "0") for _ in range(3)]
    try:
        for r in replicas:
            r.wait_applied("e0", 59)
            r.wait_applied("e1", 59)
        prompts = [p + [7, 7, 7] for p in e0.prefixes + e1.prefixes]
        answers = [[r.route(token_ids=p) for p in prompts] for r in replicas]
        assert any(a["matched_tokens"] for a in answers[0])
        key = [[(a["engine"], a["matched_tokens"]) for a in ans] for ans in answers]
        assert key[0] == key[1] == key[2]
        dumps = [httpx.get(r.url + "/v1/dump").content for r in replicas]
        assert dumps[0] == dumps[1] == dumps[2]
    finally:
        for r in replicas:
            r.close()
