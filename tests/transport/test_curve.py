"""CURVE on tcp loopback: trusted subscribers read the stream (live and replay), others
read nothing; a subscriber refuses a server that lacks the expected key."""

from __future__ import annotations

import anyio
import pytest

from kvstream.wire.events import BlockStored, KVEventBatch
from kvstream.transport import (
    CurveClientConfig,
    CurveServerConfig,
    KVEventsConfig,
    Publisher,
    SourceLive,
    SourceSpec,
    Subscriber,
)
from kvstream.transport.curve import generate_keypair, read_keypair, read_public_keys, write_keypair

from tests.transport.zmq_helpers import batches_of, collect

pytestmark = pytest.mark.anyio



def _batch(h: int) -> KVEventBatch:
    return KVEventBatch(1.0, [BlockStored([h], None, list(range(16)), 16, None, "GPU", None)])


def _cfg(server: tuple[bytes, bytes], allowed: tuple[bytes, ...] | None) -> KVEventsConfig:
    return KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                          curve=CurveServerConfig(secret_key=server[1], public_key=server[0],
                                                  allowed_clients=allowed))


async def test_trusted_subscriber_reads_live_and_replay_and_strangers_read_nothing(tmp_path):
    server = generate_keypair()
    pub_file, sec_file = write_keypair(tmp_path, "router")
    trusted_pub, trusted_sec = read_keypair(sec_file)
    assert read_public_keys([pub_file]) == (trusted_pub,)
    stranger = generate_keypair()
    trusted = CurveClientConfig(server_public_key=server[0], secret_key=trusted_sec, public_key=trusted_pub)
    other = CurveClientConfig(server_public_key=server[0], secret_key=stranger[1], public_key=stranger[0])
    with anyio.fail_after(10):
        async with Publisher(_cfg(server, (trusted_pub,))) as pub:
            pub.publish(_batch(0))  # before anyone joined: needs the (encrypted) replay
            await anyio.sleep(0.05)
            specs = [SourceSpec(pub.endpoint, pub.replay_endpoint, name="ok", curve=trusted),
                     SourceSpec(pub.endpoint, pub.replay_endpoint, name="stranger", curve=other)]
            # Retries: under load the tcp + CURVE handshake can outlast one replay timeout.
            async with Subscriber(specs, replay_timeout_s=0.5, max_retries=3) as sub:
                items = await collect(sub, lambda it: any(isinstance(i, SourceLive) and i.source == "ok" for i in it))
                # Publish until a live batch lands (the tcp+CURVE join takes a moment).
                i = 1
                while not batches_of(items, "ok")[1:]:
                    pub.publish(_batch(i))
                    i += 1
                    await anyio.sleep(0.1)
                    items += sub.get_nowait()
                # The stranger's replay requests go unanswered (refused by the ZAP handler).
                while sub.health()["stranger"].counters["timeouts"] < 1:
                    await anyio.sleep(0.1)
                items += sub.get_nowait()
                health = sub.health()
    got = [b.seq for b in batches_of(items, "ok")]
    assert got == list(range(len(got))) and len(got) >= 2
    assert batches_of(items, "stranger") == []
    assert health["stranger"].counters["timeouts"] >= 1
    assert pub.auth_denied >= 1


async def test_subscriber_refuses_a_server_without_the_expected_key():
    real, impostor = generate_keypair(), generate_keypair()
    client = generate_keypair()
    expects_real = CurveClientConfig(server_public_key=real[0], secret_key=client[1], public_key=client[0])
    with anyio.fail_after(10):
        async with Publisher(_cfg(impostor, None)) as pub:  # any client allowed, but wrong server key
            async with Subscriber([SourceSpec(pub.endpoint, name="s", curve=expects_real)]) as sub:
                await anyio.sleep(0.3)
                pub.publish(_batch(0))
                await anyio.sleep(0.3)
                assert batches_of(sub.get_nowait()) == []


async def test_curve_with_any_client_encrypts_without_an_allow_list():
    server, client = generate_keypair(), generate_keypair()
    cc = CurveClientConfig(server_public_key=server[0], secret_key=client[1], public_key=client[0])
    with anyio.fail_after(10):
        async with Publisher(_cfg(server, None)) as pub:
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")], curve=cc) as sub:
                await collect(sub, lambda it: isinstance(it[-1], SourceLive))
                items: list = []
                while not batches_of(items):  # until the tcp+CURVE join completes
                    pub.publish(_batch(5))
                    await anyio.sleep(0.1)
                    items += sub.get_nowait()
    assert batches_of(items)[0].batch.events[0].block_hashes == [5]


def test_bad_key_lengths_are_explained():
    from kvstream.transport.curve import apply_client

    import zmq

    s = zmq.Context.instance().socket(zmq.SUB)
    try:
        with pytest.raises(ValueError, match="40-byte z85"):
            apply_client(s, CurveClientConfig(server_public_key=b"short", secret_key=b"x" * 40, public_key=b"y" * 40))
    finally:
        s.close(0)
