"""CURVE on tcp loopback: trusted subscribers read the stream (live and replay), others
read nothing; a subscriber refuses a server that lacks the expected key."""

from __future__ import annotations

import re

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


async def wait_state() -> None:
    """One step of polling a state (callers hold a deadline)."""
    await anyio.sleep(0.01)


async def test_trusted_subscriber_reads_live_and_replay_and_strangers_read_nothing(tmp_path):
    server = generate_keypair()
    pub_file, sec_file = write_keypair(tmp_path, "router")
    trusted_pub, trusted_sec = read_keypair(sec_file)
    assert read_public_keys([pub_file]) == (trusted_pub,)
    stranger = generate_keypair()
    trusted = CurveClientConfig(server_public_key=server[0], secret_key=trusted_sec, public_key=trusted_pub)
    other = CurveClientConfig(server_public_key=server[0], secret_key=stranger[1], public_key=stranger[0])
    with anyio.fail_after(30):
        async with Publisher(_cfg(server, (trusted_pub,))) as pub:
            pub.publish(_batch(0))  # before anyone joined: needs the (encrypted) replay
            specs = [SourceSpec(pub.endpoint, pub.replay_endpoint, name="ok", curve=trusted),
                     SourceSpec(pub.endpoint, pub.replay_endpoint, name="stranger", curve=other)]
            # Retries: under load the tcp + CURVE handshake can outlast one replay timeout.
            async with Subscriber(specs, replay_timeout_s=0.5, max_retries=3) as sub:
                items = await collect(sub, lambda it: any(isinstance(i, SourceLive) and i.source == "ok" for i in it))
                # Only the trusted subscriber gets past the ZAP handler and subscribes.
                await pub.wait_subscribed(1)
                pub.publish(_batch(1))
                items += await collect(sub, lambda it: bool(batches_of(it, "ok")))
                # The stranger's replay requests go unanswered (refused by the ZAP handler).
                while sub.health()["stranger"].counters["timeouts"] < 1:
                    await wait_state()
                items += sub.get_nowait()
                health = sub.health()
    got = [b.seq for b in batches_of(items, "ok")]
    assert got == [0, 1]
    assert batches_of(items, "stranger") == []
    assert health["stranger"].counters["timeouts"] >= 1
    assert pub.auth_denied >= 1 and pub.stats.subscriptions == 1


async def test_subscriber_refuses_a_server_without_the_expected_key():
    real, impostor = generate_keypair(), generate_keypair()
    client = generate_keypair()
    expects_real = CurveClientConfig(server_public_key=real[0], secret_key=client[1], public_key=client[0])
    expects_impostor = CurveClientConfig(server_public_key=impostor[0], secret_key=client[1], public_key=client[0])
    with anyio.fail_after(30):
        async with Publisher(_cfg(impostor, None)) as pub:  # any client allowed, but wrong server key
            specs = [SourceSpec(pub.endpoint, name="fooled", curve=expects_real),
                     SourceSpec(pub.endpoint, name="control", curve=expects_impostor)]
            async with Subscriber(specs) as sub:
                # The control subscriber (same client, the key this server really has) joins;
                # the other one's handshake was refused at the same time, so it never will.
                await pub.wait_subscribed(1)
                pub.publish(_batch(0))
                items = await collect(sub, lambda it: bool(batches_of(it, "control")))
                items += sub.get_nowait()
    assert batches_of(items, "fooled") == [] and pub.stats.subscriptions == 1


async def test_curve_with_any_client_encrypts_without_an_allow_list():
    server, client = generate_keypair(), generate_keypair()
    cc = CurveClientConfig(server_public_key=server[0], secret_key=client[1], public_key=client[0])
    with anyio.fail_after(30):
        async with Publisher(_cfg(server, None)) as pub:
            async with Subscriber([SourceSpec(pub.endpoint, pub.replay_endpoint, name="s")], curve=cc) as sub:
                await pub.wait_subscribed(1)  # the tcp + CURVE join is complete
                pub.publish(_batch(5))
                items = await collect(sub, lambda it: bool(batches_of(it)))
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


def test_write_keypair_makes_the_secret_file_private_whatever_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        pub_file, sec_file = write_keypair(tmp_path, "engine")
        (tmp_path / "again.key_secret").write_text("stale")
        os.chmod(tmp_path / "again.key_secret", 0o666)  # an existing file is tightened too
        _, sec_again = write_keypair(tmp_path, "again")
    finally:
        os.umask(old)
    assert os.stat(sec_file).st_mode & 0o777 == 0o600
    assert os.stat(sec_again).st_mode & 0o777 == 0o600
    assert os.stat(pub_file).st_mode & 0o777 == 0o644
    public, secret = read_keypair(sec_file)
    assert read_keypair(pub_file) == (public, None) and len(secret) == 40
    import zmq.auth  # the files stay readable by zmq.auth's own loader

    assert zmq.auth.load_certificate(str(sec_file)) == (public, secret)


def test_a_secret_file_others_can_read_is_refused_with_the_fix_unless_allowed(tmp_path, caplog):
    import os

    from kvstream.errors import LocalProtocolError
    from kvstream.transport.curve import InsecureKeyFileError

    pub_file, sec_file = write_keypair(tmp_path, "engine")
    for mode in (0o644, 0o640, 0o604):
        os.chmod(sec_file, mode)
        with pytest.raises(InsecureKeyFileError) as err:
            read_keypair(sec_file)
        assert str(sec_file) in str(err.value) and f"{mode:04o}" in str(err.value)
        assert f"chmod 600 {sec_file}" in str(err.value)
        assert isinstance(err.value, LocalProtocolError) and err.value.mode == mode
    with caplog.at_level("WARNING"):
        assert read_keypair(sec_file, allow_insecure=True)[1] is not None
    assert "chmod 600" in caplog.text
    os.chmod(pub_file, 0o666)
    assert read_keypair(pub_file)[1] is None  # a public key is no secret
    assert read_public_keys([tmp_path]) == (read_keypair(pub_file)[0],)


@pytest.mark.parametrize("content, says", [
    (b"abc", "has no public-key line (3 bytes)"),
    (b"", "has no public-key line (0 bytes)"),
    (b"\xff\xfe\x00garbage\n", "has no public-key line"),
    (b'curve\n    public-key = "short"\n', "public-key is not a 40-character z85 key (got 5 characters)"),
    (b'curve\n    public-key = "' + b"~" * 40 + b'"\n', "public-key is not a 40-character z85 key"),
    (b"x" * 70_000, "over 65536 bytes"),
])
def test_a_malformed_key_file_is_a_typed_error_naming_the_file(tmp_path, content, says):
    from kvstream.errors import LocalProtocolError
    from kvstream.transport.curve import KeyFileError

    f = tmp_path / "bad.key"
    f.write_bytes(content)
    with pytest.raises(KeyFileError, match=re.escape(says)) as err:
        read_keypair(f)
    assert str(f) in str(err.value) and err.value.path == f
    assert isinstance(err.value, LocalProtocolError)


def test_a_secret_key_that_does_not_match_its_public_key_is_refused(tmp_path):
    import os

    from kvstream.transport.curve import KeyFileError

    a_pub, a_sec = generate_keypair()
    b_pub, _ = generate_keypair()
    f = tmp_path / "mixed.key_secret"
    f.write_text(f'curve\n    public-key = "{b_pub.decode()}"\n    secret-key = "{a_sec.decode()}"\n')
    os.chmod(f, 0o600)
    with pytest.raises(KeyFileError, match="does not belong to its public-key"):
        read_keypair(f)
