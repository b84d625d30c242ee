"""The emulated engine's KV events, as a router and a raw ZMQ subscriber see them."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstream.emulator.launch import start_engine
from kvstream.routing.index import KVIndex
from kvstream.routing.router import Router
from kvstream.transport.subscriber import SourceSpec


@pytest.mark.parametrize("wire, event_shape", [("0.11", list), ("0.26", dict)])
def test_requests_become_events_in_the_chosen_wire_version(tmp_path: Path, wire: str, event_shape: type) -> None:
    engine = start_engine("e0", extra=["--wire-version", wire], log_dir=str(tmp_path))
    try:
        async def go() -> tuple[int, object]:
            ctx = zmq.asyncio.Context.instance()
            raw = ctx.socket(zmq.SUB)
            raw.setsockopt(zmq.SUBSCRIBE, b"")
            raw.connect(engine.events or "")
            spec = SourceSpec(engine.events or "", engine.replay, name="e0")
            async with Router([spec], index=KVIndex(router_block_size=16)) as router, \
                    httpx.AsyncClient(base_url=engine.url) as client:
                with anyio.fail_after(30):
                    while router.health()["e0"].state != "live":
                        await anyio.sleep(0.01)
                prompt = list(range(1, 50))  # 3 full blocks
                seq = -1
                first_event: object = None
                with anyio.fail_after(30):
                    # The raw SUB may join after the first batch: ask again until it sees one.
                    while first_event is None:
                        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                        assert r.status_code == 200
                        with anyio.move_on_after(0.5):
                            frames = await raw.recv_multipart()
                            seq = int.from_bytes(frames[1], "big")
                            first_event = msgspec.msgpack.decode(frames[2])[1][0]
                    await router.wait_applied("e0", seq)
                raw.close(0)
                return router.index.score(prompt).matches["e0"].blocks, first_event

        blocks, event = anyio.run(go)
    finally:
        engine.stop()
    assert blocks == 3
    assert isinstance(event, event_shape)


def test_wire_version_011_takes_vllm_011_rules_for_the_publisher(capsys) -> None:
    from kvstream.cli.engine import events_config

    # vLLM 0.11: events enabled without a publisher name publish nothing ("null").
    cfg = events_config('{"enable_kv_cache_events": true}', "0.11")
    assert (cfg.vllm_version, cfg.publisher, cfg.encoding) == ("0.11", "null", "array")
    assert "none will be sent" in capsys.readouterr().err
    cfg = events_config('{"enable_kv_cache_events": true, "publisher": "zmq"}', "0.11")
    assert (cfg.vllm_version, cfg.publisher) == ("0.11", "zmq")
    assert capsys.readouterr().err == ""
    # The default wire (0.26+ maps) keeps 0.33's rule: enabled means zmq.
    assert events_config('{"enable_kv_cache_events": true}', "0.26").publisher == "zmq"
