"""CURVE encryption and authentication for the stream's tcp sockets (pyzmq's ``zmq.auth``).

Off by default, like vLLM. With it on:

* the publisher's PUB and ROUTER sockets are CURVE servers holding the engine's secret key;
  a subscriber configured with the engine's public key refuses any other server, so a
  router accepts events only from engines it trusts;
* with ``allowed_clients`` set, the publisher's ZAP handler accepts only those subscriber
  public keys, so nobody else can read the events (without it, any client that knows the
  server key may connect; traffic is still encrypted).

Keys are z85-encoded 40-byte strings. ``generate_keypair`` makes one in memory;
``write_keypair``/``read_keypair`` store it as zmq.auth certificate files
(``name.key`` public, ``name.key_secret`` secret).

The ZAP handler runs as a task of the publisher's task group (:class:`ZapHandler`), on its
own ZMQ context: libzmq allows one ZAP endpoint per context.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import anyio
import zmq
import zmq.auth
from zmq.auth.base import Authenticator

from kvstream.transport.config import CurveClientConfig, CurveServerConfig

__all__ = ["generate_keypair", "write_keypair", "read_keypair", "read_public_keys",
           "apply_server", "apply_client", "ZapHandler"]

log = logging.getLogger(__name__)


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh CURVE keypair ``(public, secret)``, each 40 z85 bytes."""
    if not zmq.has("curve"):  # pragma: no cover - libzmq built without libsodium
        raise RuntimeError("this libzmq has no CURVE support; install a pyzmq wheel with curve")
    return zmq.curve_keypair()


def write_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Create a keypair and write it as zmq.auth certificates in ``directory``;
    returns ``(public_file, secret_file)``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.auth.create_certificates(str(d), name)
    return Path(pub), Path(sec)


def read_keypair(path: str | Path) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` from a zmq.auth certificate file (secret None for a ``.key``
    file holding only the public key)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"CURVE certificate {p} does not exist (create one with write_keypair)")
    public, secret = zmq.auth.load_certificate(str(p))
    return public, secret


def read_public_keys(paths: Iterable[str | Path]) -> tuple[bytes, ...]:
    """Public keys from certificate files or directories of ``.key`` files."""
    keys: list[bytes] = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            keys.extend(zmq.auth.load_certificates(str(p)).keys())
        else:
            keys.append(read_keypair(p)[0])
    return tuple(keys)


def _check_key(key: bytes, what: str) -> bytes:
    if isinstance(key, str):
        key = key.encode("ascii")
    if len(key) != 40:
        raise ValueError(f"{what} must be a 40-byte z85 CURVE key, got {len(key)} bytes "
                         "(generate one with kvstream.transport.curve.generate_keypair)")
    return key


def apply_server(sock: zmq.Socket, cfg: CurveServerConfig) -> None:
    """Make ``sock`` a CURVE server (call before bind)."""
    sock.curve_secretkey = _check_key(cfg.secret_key, "curve secret_key")
    sock.curve_publickey = _check_key(cfg.public_key, "curve public_key")
    sock.curve_server = True


def apply_client(sock: zmq.Socket, cfg: CurveClientConfig) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is in ``cfg`` (call before connect)."""
    sock.curve_serverkey = _check_key(cfg.server_public_key, "curve server_public_key")
    sock.curve_secretkey = _check_key(cfg.secret_key, "curve secret_key")
    sock.curve_publickey = _check_key(cfg.public_key, "curve public_key")


class _AllowList:
    __slots__ = ("_keys", "denied")

    def __init__(self, keys: Iterable[bytes]) -> None:
        self._keys = frozenset(_check_key(k, "allowed client key") for k in keys)
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self._keys
        if not ok:
            self.denied += 1
            log.warning("CURVE: refused a subscriber with unknown public key %s", key.decode("ascii", "replace"))
        return ok


class ZapHandler:
    """The ZAP (authentication) endpoint of one ZMQ context, served from an anyio task.

    ``start()`` binds it (before any CURVE server socket binds), :meth:`run` answers
    requests until cancelled, ``close()`` unbinds. ``denied`` counts refused clients.
    """

    __slots__ = ("_auth", "_allow")

    def __init__(self, ctx: zmq.Context, allowed_clients: Iterable[bytes] | None) -> None:
        self._auth = Authenticator(ctx, log=logging.getLogger("kvstream.transport.zap"))
        self._allow = _AllowList(allowed_clients) if allowed_clients is not None else None

    @property
    def denied(self) -> int:
        """Connection attempts refused because the client key was not allowed."""
        return self._allow.denied if self._allow is not None else 0

    def start(self) -> None:
        """Bind the ZAP endpoint and install the policy."""
        self._auth.start()
        if self._allow is None:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._allow)

    async def run(self) -> None:
        """Answer ZAP requests until cancelled (edge-triggered FD: drain, then wait)."""
        sock = self._auth.zap_socket
        while True:
            # getsockopt is typed int | bytes; EVENTS is an int option.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # type: ignore[arg-type, operator]
                try:
                    msg = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    await self._auth.handle_zap_message(msg)
                except Exception:  # noqa: BLE001 - a bad ZAP request must not end the publisher
                    log.exception("CURVE: failed to handle a ZAP request")
            await anyio.wait_readable(sock.FD)

    def close(self) -> None:
        """Unbind the ZAP endpoint."""
        self._auth.stop()
