"""``serve --proxy --scoring cost --speculate`` in the request path, real processes: a burst
of requests sharing a new prefix, sent together, follows the first one to its engine and
reuses the prefix there, whenever the engine's KV events arrive."""

from __future__ import annotations

import random
from typing import Any, Iterator

import anyio
import httpx
import pytest

from kvstream.emulator.launch import Proc
from tests.proxy.stack import engines_and_proxy

ENGINE_OPTS = ["--num-gpu-blocks", "2048", "--prefill-tokens-per-s", "20000", "--decode-tokens-per-s", "200",
               "--max-model-len", "8192"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    with engines_and_proxy(str(tmp_path_factory.mktemp("logs")), ENGINE_OPTS,
                           ["--scoring", "cost", "--speculate", "--speculate-ttl", "30"], n=3) as stack:
        yield stack


async def burst(url: str, prefix: list[int], size: int, rng: random.Random) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient) -> None:
        prompt = prefix + [rng.randrange(1000, 30000) for _ in range(32)]
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        out.append({"status": r.status_code, "engine": r.headers.get("x-kvstream-engine"),
                    "cached": (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0})

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async with anyio.create_task_group() as tg:
            for _ in range(size):
                tg.start_soon(one, client)
    return out


def test_a_burst_of_one_new_prefix_lands_on_one_engine_and_reuses_it(stack: tuple[Proc, list[Proc]]) -> None:
    proxy, _ = stack
    rng = random.Random(5)
    homes = set()
    for g in range(3):
        prefix = [rng.randrange(1000, 30000) for _ in range(1024)]
        answers = anyio.run(burst, proxy.url or "", prefix, 6, rng)
        assert all(a["status"] == 200 for a in answers), answers
        engines = {a["engine"] for a in answers}
        assert len(engines) == 1, answers  # the speculated prefix, not the events, drew them together
        # The engine computed the prefix once: every other request found it cached.
        assert sorted(a["cached"] for a in answers)[1:] == [1024] * 5, answers
        homes |= engines
    # New prefixes are still spread (the placement model balances new work).
    assert len(homes) >= 2
