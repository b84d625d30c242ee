"""Engines added and removed while the service runs (``/register`` and ``/unregister``
racing queries, ``SIGHUP`` reloads): the engines that stay are followed throughout.

Found by a campaign of two threads registering and unregistering one instance while three
queried and ``SIGHUP`` toggled a second engine: 100 ms in, an engine removed before its
stream task first ran killed the subscriber's task group (``assert sock is not None`` in
its live loop), and the service went on answering from a frozen index with every engine
``connecting``."""

from __future__ import annotations

import anyio
import anyio.to_thread
import httpx
import msgspec

from kvstream.service.config import build_config
from kvstream.service.core import DEFAULT_INDEX, ServiceCore
from kvstream.service.runtime import ServiceRuntime
from kvstream.transport.subscriber import SourceSpec
from tests.service.conftest import wait_for

PROMPT = [5000 + i for i in range(64)]


def test_an_engine_removed_before_its_stream_task_ran_leaves_the_others_followed(engines) -> None:
    e = engines("e0")
    core = ServiceCore(build_config({"load_interval": 0}, [e.arg], None))

    async def main() -> None:
        async with ServiceRuntime(core):
            # Added and removed in one go: its task is scheduled but has not run yet.
            core.add_engine(SourceSpec(e.pub, e.replay, "gone"), DEFAULT_INDEX)
            core.remove_engine("gone")
            seq = await anyio.to_thread.run_sync(e.admit, PROMPT, "r1")
            with anyio.fail_after(60):
                while core.applied.get("e0", -1) < seq:
                    await anyio.sleep(0.01)
            assert core.failure is None

    anyio.run(main)


def test_registration_churn_and_reloads_keep_the_configured_engine_followed(engines, serve, tmp_path) -> None:
    e = engines("e0")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'engines = ["{e.arg}"]\n')
    srv = serve("--config", str(cfg), "--load-interval", "0")
    srv.wait_applied("e0", e.admit(PROMPT, "r1"))
    reg = {"endpoint": e.pub, "replay_endpoint": e.replay, "type": "vLLM", "modelname": "m", "instance_id": "i1",
           "block_size": 16, "dp_rank": 0, "tenant_id": "t"}
    other = e.arg.replace("e0=", "e9=")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for i in range(30):
            assert c.post("/register", json=reg).status_code == 200
            assert c.post("/unregister", json={"instance_id": "i1", "tenant_id": "t"}).status_code == 200
            q = c.post("/query", json={"model": "m", "token_ids": PROMPT, "block_size": 16, "tenant_id": "t"})
            assert q.status_code == 200, q.text
            if i % 5 == 0:  # a reload adding or dropping a second engine on the same publisher
                cfg.write_text(f'engines = ["{e.arg}"' + (f', "{other}"' if i % 10 == 0 else "") + "]\n")
                srv.signal(1)  # SIGHUP
        assert c.get("/healthz").status_code == 200
    srv.wait_applied("e0", e.admit(PROMPT + [1] * 16, "r2"))  # still following
    assert srv.route(token_ids=PROMPT)["matched_tokens"] == 64


def test_an_instance_registered_and_unregistered_again_before_the_last_removal_drained(engines) -> None:
    # Before: the second /unregister raised KeyError (a 500; with --workers 2, 772 logged
    # errors in a churn run) after dropping the engine from the core but not from the
    # subscriber, so every later /register of it was refused as "already followed".
    from kvstream.service.mooncake import MooncakeAPI

    e = engines("e0")
    core = ServiceCore(build_config({"load_interval": 0}, [], None))
    mc = MooncakeAPI(core)
    reg = ('{"endpoint": "%s", "replay_endpoint": "%s", "type": "vLLM", "modelname": "m", "instance_id": "i1", '
           '"block_size": 16, "dp_rank": 0, "tenant_id": "t"}' % (e.pub, e.replay)).encode()
    unreg = b'{"instance_id": "i1", "tenant_id": "t"}'
    query = ('{"model": "m", "block_size": 16, "tenant_id": "t", "token_ids": %s}' % PROMPT).encode()

    async def main() -> None:
        async with ServiceRuntime(core):
            for _ in range(3):  # no await in between: no removal's reset is applied yet
                mc.register(reg)
                mc.unregister(unreg)
            mc.register(reg)
            seq = await anyio.to_thread.run_sync(e.admit, PROMPT, "r1")
            with anyio.fail_after(60):
                while core.applied.get("i1|t|0", -1) < seq:
                    await anyio.sleep(0.01)
            assert msgspec.json.decode(mc.query(query)) == {
                "t": {"i1": {"longest_matched": 64, "GPU": 64, "CPU": 0, "DISK": 0, "DP": {"0": 64}}}}
            mc.unregister(unreg)
            mc.register(reg)  # not refused as "already followed"

    anyio.run(main)
