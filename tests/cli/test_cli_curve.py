"""CURVE from the command line: `kvstream record` with the shared --curve-* flags against a
publisher that only admits allow-listed subscribers (real tcp sockets on loopback)."""

from __future__ import annotations

import sys

import anyio
import pytest

from kvstream.eventlog import LogMessage, read_log
from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.transport import CurveServerConfig, KVEventsConfig, Publisher
from kvstream.transport.curve import read_keypair, write_keypair

pytestmark = pytest.mark.anyio



def _batch(h: int) -> KVEventBatch:
    return KVEventBatch(float(h), [BlockStored([h], None, list(range(16)), 16, None, "GPU", None)])


async def _record(pub: Publisher, args: list[str], *, joins: bool, publish: int) -> tuple[int, str]:
    """Run ``kvstream record`` against ``pub``; once it has subscribed (if ``joins``),
    publish ``publish`` batches; returns (exit code, stderr)."""
    joined = pub.stats.subscriptions + 1
    async with await anyio.open_process([sys.executable, "-m", "kvstream", "record", *args, "--quiet"],
                                        stdout=None) as proc:
        if joins:
            await pub.wait_subscribed(joined)  # readiness: its SUB's filter reached the publisher
            for i in range(publish):
                pub.publish(_batch(pub.next_seq + 1))
        code = await proc.wait()
        assert proc.stderr is not None
        err = (await proc.stderr.receive()).decode() if code else ""
    return code, err


async def test_record_with_an_allowed_certificate_records_and_a_stranger_is_refused(tmp_path):
    server_pub_file, server_sec_file = write_keypair(tmp_path / "server", "engine")
    router_pub_file, router_sec_file = write_keypair(tmp_path / "router", "router")
    _, stranger_sec_file = write_keypair(tmp_path / "stranger", "stranger")
    server_pub, server_sec = read_keypair(server_sec_file)
    router_pub, _ = read_keypair(router_pub_file)
    cfg = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                         curve=CurveServerConfig(secret_key=server_sec, public_key=server_pub,
                                                 allowed_clients=(router_pub,)))
    good, bad = tmp_path / "good.kvlog", tmp_path / "bad.kvlog"
    with anyio.fail_after(30):
        async with Publisher(cfg) as pub:
            ep = f"e0={pub.endpoint},{pub.replay_endpoint}"
            ok = await _record(pub, [ep, "-o", str(good), "--max-batches", "3", "--curve-server-key",
                                     str(server_pub_file), "--curve-cert", str(router_sec_file)], joins=True, publish=3)
            refused = await _record(pub, [ep, "-o", str(bad), "--duration", "1.5", "--curve-server-key",
                                          str(server_pub_file), "--curve-cert", str(stranger_sec_file)],
                                    joins=False, publish=0)
            denied = pub.auth_denied
    assert ok[0] == 0, ok[1]
    msgs = [r for r in read_log(good)[0] if isinstance(r, LogMessage)]
    assert len(msgs) >= 3 and all(m.source == "e0" for m in msgs)
    assert refused[0] == 0, refused[1]
    assert not [r for r in read_log(bad)[0] if isinstance(r, LogMessage)]
    assert denied > 0 and pub.stats.subscriptions == 1


def test_curve_cert_without_server_key_is_a_usage_error(tmp_path, capsys):
    from kvstream.cli import main

    code = main(["subscribe", "tcp://127.0.0.1:1", "--curve-cert", str(tmp_path / "x.key_secret")])
    assert code == 2
    assert "--curve-cert needs --curve-server-key" in capsys.readouterr().err
