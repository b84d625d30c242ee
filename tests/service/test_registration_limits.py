"""Registrations cannot take the service down or pile up: the number of engines is capped
(``--max-engines``, a 429 beyond), any failure to follow a registered engine is a 4xx that
leaves the event stream running, and ``/unregister`` takes an emptied (model, tenant, block
size, salt, LoRA) group away with its index and its metric series.

Found by an adversarial pass (issue #23): about 255 ``POST /register`` of publishers nobody
runs exhausted pyzmq's 1,023 sockets; registration #255 got a 500 and the event stream
runtime ended. 70 cycles of 200 registrations and unregistrations left 14,001 index series
on ``/metrics`` (RSS 65 -> 126 MB) with no engine followed.
"""

from __future__ import annotations

import json

import anyio
import anyio.to_thread
import httpx
import pytest
import zmq

from kvstream.service.config import build_config
from kvstream.service.core import DEFAULT_INDEX, ServiceCore
from kvstream.service.errors import ApiError
from kvstream.service.mooncake import MooncakeAPI
from kvstream.service.runtime import ServiceRuntime
from kvstream.transport.subscriber import SourceSpec
from tests.service.conftest import dead_port, wait_for

PROMPT = [7000 + i for i in range(64)]


def _reg(i: int, **kw: object) -> dict:
    return {"endpoint": f"tcp://127.0.0.1:{dead_port()}", "replay_endpoint": f"tcp://127.0.0.1:{dead_port()}",
            "type": "vLLM", "modelname": "m", "instance_id": f"i{i}", "block_size": 16, "dp_rank": 0,
            "tenant_id": f"t{i}", **kw}


def test_registrations_beyond_max_engines_are_429_and_the_event_stream_keeps_following(engines, serve) -> None:
    e = engines("e0")
    srv = serve(e.arg, "--load-interval", "0")  # the default --max-engines (256), the configured engine one of them
    srv.wait_applied("e0", e.admit(PROMPT, "r1"))
    codes = []
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for i in range(300):
            r = c.post("/register", json=_reg(i))
            codes.append(r.status_code)
            if r.status_code != 200:
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["code"] == "too_many_engines" and "--max-engines 256" in err["message"], err
        assert codes == [200] * 255 + [429] * 45
        assert c.get("/healthz").status_code == 200
        assert len(c.get("/v1/engines").json()["engines"]) == 256
        # the event stream still runs: a new batch of the configured engine is applied
        srv.wait_applied("e0", e.admit(PROMPT + [1] * 16, "r2"))
        # room again after an unregister
        assert c.post("/unregister", json={"instance_id": "i0", "tenant_id": "t0"}).status_code == 200
        assert c.post("/register", json=_reg(1000)).status_code == 200
        assert c.post("/register", json=_reg(1001)).status_code == 429
    assert srv.close() == 0


def test_a_registration_the_subscriber_cannot_take_is_a_4xx_and_the_runtime_survives(engines) -> None:
    # A ZMQ context with room for few sockets: the subscriber's add_source fails with a
    # ZMQError (not a ValueError), as when a process runs out of sockets or descriptors.
    e = engines("e0")
    core = ServiceCore(build_config({"load_interval": 0}, [e.arg.split(",")[0]], None))  # no replay: one socket
    mc = MooncakeAPI(core)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 4)

    async def main() -> None:
        async with ServiceRuntime(core, context=ctx):
            statuses = []
            for i in range(6):
                body = json.dumps(_reg(i, replay_endpoint=None)).encode()
                try:
                    mc.register(body)
                    statuses.append(200)
                except ApiError as exc:
                    statuses.append(exc.status)
                    assert exc.code == "no_capacity", exc.message
            assert 429 in statuses and set(statuses) <= {200, 429}, statuses
            # the refused ones are not followed, and their groups are gone with them
            followed = {n for n in core.engines if n != "e0"}
            assert len(followed) == statuses.count(200)
            assert set(core.indexes) == {DEFAULT_INDEX} | {core.engines[n].index for n in followed}
            # e0 has no replay endpoint, so a batch published before its SUB has joined is
            # gone for good (ZMQ's slow joiner): publish new prompts until one is applied.
            with anyio.fail_after(60):
                for k in range(1, 10**6):
                    seq = await anyio.to_thread.run_sync(e.admit, PROMPT + [k] * 16, f"r{k}")
                    with anyio.move_on_after(1):
                        while core.applied.get("e0", -1) < seq:
                            await anyio.sleep(0.01)
                    if core.applied.get("e0", -1) >= seq:
                        break
            assert core.failure is None

    try:
        anyio.run(main)
    finally:
        ctx.destroy(linger=0)


def _index_series(c: httpx.Client) -> list[str]:
    return [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("kvstream_index_entries{")]


def _engine_series(c: httpx.Client) -> list[str]:
    return [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith("kvstream_engine_state{")]


@pytest.mark.parametrize("kind", ["vLLM", "Mooncake"])
def test_unregister_drops_the_emptied_group_its_index_and_its_series(serve, kind: str) -> None:
    srv = serve("--load-interval", "0")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        base = _index_series(c)
        assert len(base) == 1  # the configured engines' default index
        for cycle in range(3):
            for i in range(40):  # each in its own group (tenant), two DP ranks in the first
                assert c.post("/register", json=_reg(i, type=kind)).status_code == 200
            assert c.post("/register", json=_reg(0, type=kind, dp_rank=1)).status_code == 200
            assert len(_index_series(c)) == 1 + 40
            for i in range(40):
                r = c.post("/unregister", json={"instance_id": f"i{i}", "tenant_id": f"t{i}"})
                assert r.status_code == 200, r.text
            assert _index_series(c) == base, cycle
            assert _engine_series(c) == []
            assert c.get("/v1/engines").json() == {"engines": []}
        # a group that keeps one engine stays; the default group is never dropped
        for rank in (0, 1):
            assert c.post("/register", json=_reg(7, dp_rank=rank, tenant_id="t")).status_code == 200
        assert c.post("/unregister", json={"instance_id": "i7", "tenant_id": "t", "dp_rank": 0}).status_code == 200
        assert len(_index_series(c)) == 2
        q = c.post("/query", json={"model": "m", "token_ids": PROMPT, "block_size": 16, "tenant_id": "t"})
        assert q.status_code == 200 and q.json() == {"t": {}}


def test_a_registration_in_the_configured_engines_group_leaves_the_default_index(engines, serve) -> None:
    e = engines("e0")
    srv = serve(e.arg, "--load-interval", "0", "--model-name", "m")
    seq = e.admit(PROMPT, "r1")
    srv.wait_applied("e0", seq)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        reg = {**_reg(1), "tenant_id": "default"}
        assert c.post("/register", json=reg).status_code == 200
        assert c.post("/unregister", json={"instance_id": "i1"}).status_code == 200
        assert len(_index_series(c)) == 1
        def matched() -> int:
            got = c.post("/query", json={"model": "m", "token_ids": PROMPT, "block_size": 16}).json()
            return got["default"].get("e0", {}).get("longest_matched", 0)
        assert wait_for(lambda: matched() == 64, "the configured engine still answering /query")


def test_the_engine_limit_is_a_flag_and_a_config_key(tmp_path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text("max-engines = 2\n")
    cfg = build_config({}, [], str(f))
    assert cfg.max_engines == 2
    core = ServiceCore(cfg)
    core.add_engine(SourceSpec("tcp://127.0.0.1:1", None, "a"), DEFAULT_INDEX)
    core.add_engine(SourceSpec("tcp://127.0.0.1:2", None, "b"), DEFAULT_INDEX)
    with pytest.raises(ApiError) as err:
        core.add_engine(SourceSpec("tcp://127.0.0.1:3", None, "c"), DEFAULT_INDEX)
    assert err.value.status == 429 and err.value.code == "too_many_engines"
    assert build_config({"max_engines": 5}, [], str(f)).max_engines == 5
