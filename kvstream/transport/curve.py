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
(``name.key`` public, ``name.key_secret`` secret, written with mode 0600). Reading a secret
file that its group or other users can access is refused (:class:`InsecureKeyFileError`,
``allow_insecure=True`` to accept it with a warning); a damaged file is a
:class:`KeyFileError` naming the file, never a traceback from deep inside.

The ZAP handler runs as a task of the publisher's task group (:class:`ZapHandler`), on its
own ZMQ context: libzmq allows one ZAP endpoint per context.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Iterable

import anyio
import zmq
import zmq.auth
from zmq.auth.base import Authenticator
from zmq.utils import z85

from kvstream.errors import LocalProtocolError
from kvstream.transport.config import CurveClientConfig, CurveServerConfig

__all__ = ["generate_keypair", "write_keypair", "read_keypair", "read_public_keys",
           "apply_server", "apply_client", "ZapHandler", "KeyFileError", "InsecureKeyFileError"]

log = logging.getLogger(__name__)


class KeyFileError(LocalProtocolError, ValueError):
    """A CURVE key file cannot be used: unreadable, malformed (not a zmq.auth certificate,
    a key that is not 40 z85 characters, a secret key that does not match the public key)
    or, see :class:`InsecureKeyFileError`, readable by other users. The message names the
    file and the fix. ``path`` is the file."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class InsecureKeyFileError(KeyFileError):
    """A file holding a CURVE secret key is readable or writable by its group or by other
    users. ``mode`` is the file's permission bits; ``chmod 600 FILE`` fixes it (or pass
    ``allow_insecure=True`` to :func:`read_keypair` to accept it on purpose)."""

    def __init__(self, message: str, path: Path, mode: int) -> None:
        super().__init__(message, path)
        self.mode = mode


_MAX_KEY_FILE_BYTES = 64 * 1024
"""A certificate is a few hundred bytes; anything past this is not one."""


def generate_keypair() -> tuple[bytes, bytes]:
    """A fresh CURVE keypair ``(public, secret)``, each 40 z85 bytes."""
    if not zmq.has("curve"):  # pragma: no cover - libzmq built without libsodium
        raise RuntimeError("this libzmq has no CURVE support; install a pyzmq wheel with curve")
    return zmq.curve_keypair()


def _certificate(public: bytes, secret: bytes | None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate (written by kvstream)"]
    if secret is not None:
        lines.append("#   Keep this file private (mode 0600): it authenticates its owner.")
    lines += ["", "metadata", "curve", f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str, mode: int) -> None:
    # Created with the final mode (never briefly readable by others), and re-chmodded in
    # case the file already existed with wider permissions.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def write_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Create a keypair and write it as zmq.auth certificates in ``directory``; returns
    ``(public_file, secret_file)`` (``name.key``, mode 0644, and ``name.key_secret``, mode
    0600 whatever the umask)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = generate_keypair()
    pub_file, sec_file = d / f"{name}.key", d / f"{name}.key_secret"
    _write_private(pub_file, _certificate(public, None), 0o644)
    _write_private(sec_file, _certificate(public, secret), 0o600)
    return pub_file, sec_file


def _parse_key(value: bytes, what: str, p: Path) -> bytes:
    key = value.strip().strip(b"\"'")
    try:
        raw = z85.decode(key) if len(key) == 40 else b""
    except (ValueError, KeyError, IndexError):
        raw = b""
    if len(raw) != 32:
        raise KeyFileError(
            f"CURVE certificate {p}: its {what} is not a 40-character z85 key (got {len(key)} "
            "characters); the file is damaged or not a certificate. Create a new keypair with "
            "kvstream.transport.curve.write_keypair.", p)
    return key


def read_keypair(path: str | Path, *, allow_insecure: bool = False) -> tuple[bytes, bytes | None]:
    """``(public, secret)`` from a zmq.auth certificate file (secret None for a ``.key``
    file holding only the public key).

    Raises :class:`FileNotFoundError` for a missing file, :class:`KeyFileError` for a file
    that is not a valid certificate, and :class:`InsecureKeyFileError` for a file holding
    a secret key that its group or other users may read or write (unless
    ``allow_insecure``; then it is only logged as a warning).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"CURVE certificate {p} does not exist (create one with write_keypair)")
    try:
        with open(p, "rb") as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    except OSError as exc:
        raise KeyFileError(f"CURVE certificate {p} cannot be read: {exc.strerror or exc}", p) from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"CURVE certificate {p} is over {_MAX_KEY_FILE_BYTES} bytes: not a certificate", p)
    public = secret = None
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"#") or b"=" not in line:
            continue
        name, value = (part.strip() for part in line.split(b"=", 1))
        if name == b"public-key" and public is None:
            public = _parse_key(value, "public-key", p)
        elif name == b"secret-key" and secret is None:
            secret = _parse_key(value, "secret-key", p)
    if public is None:
        raise KeyFileError(
            f"CURVE certificate {p} has no public-key line ({len(data)} bytes); the file is damaged "
            "or not a zmq.auth certificate. Create a new keypair with kvstream.transport.curve.write_keypair.", p)
    if secret is not None:
        if mode & 0o077:
            msg = (f"CURVE secret key file {p} has mode {mode:04o}: its group or other users can access it. "
                   f"Run `chmod 600 {p}`")
            if not allow_insecure:
                raise InsecureKeyFileError(msg + " (or pass allow_insecure=True to accept it).", p, mode)
            log.warning("%s; accepted because allow_insecure=True", msg)
        if zmq.curve_public(secret) != public:
            raise KeyFileError(f"CURVE certificate {p}: its secret-key does not belong to its public-key; "
                               "the file is damaged. Create a new keypair with write_keypair.", p)
    return public, secret


def read_public_keys(paths: Iterable[str | Path]) -> tuple[bytes, ...]:
    """Public keys from certificate files or directories of ``.key`` files (in name order)."""
    keys: list[bytes] = []
    for path in paths:
        p = Path(path)
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        # Only the public keys are used, so a secret file's permissions do not matter here.
        keys.extend(read_keypair(f, allow_insecure=True)[0] for f in files)
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
