"""What every command that follows engines shares: the endpoint syntax and CURVE flags.

``[NAME=]PUB[,REPLAY]`` with optional ``,replay=ENDPOINT``, ``,name=NAME`` and
``,forwarded=yes`` (a forwarder sits between the engine and us: see
:class:`~kvstream.transport.SourceSpec`) options, e.g. ``e0=tcp://h:5557,tcp://h:5558`` or
``tcp://h:5557,replay=tcp://h:5558,name=e0``.
"""

from __future__ import annotations

import argparse

from kvstream.transport import CurveClientConfig, SourceSpec

__all__ = ["parse_source", "parse_forwarded", "SYNTAX", "add_curve_client_args", "curve_client_from_args",
           "check_connect_endpoint", "check_bind_endpoint", "check_distinct_bind_endpoints"]

SYNTAX = ("[NAME=]PUB[,REPLAY][,forwarded=yes] (or PUB,replay=REPLAY,name=NAME), "
          "e.g. e0=tcp://h:5557,tcp://h:5558")

_YES, _NO = ("yes", "true", "1"), ("no", "false", "0")


def parse_forwarded(value: str, where: str) -> bool:
    """``forwarded=`` of an endpoint argument: yes/true/1 or no/false/0; ValueError otherwise."""
    if value.lower() in _YES:
        return True
    if value.lower() in _NO:
        return False
    raise ValueError(f"forwarded= takes yes or no, got {value!r} in {where!r}")


def parse_source(text: str, replay: str | None = None, name: str | None = None) -> SourceSpec:
    """Parse one endpoint argument into a :class:`SourceSpec`; ``replay``/``name`` are
    defaults (from separate flags) that the text may override. Raises ``ValueError``
    saying what is wrong and the accepted syntax."""
    flag_replay, flag_name = replay, name
    head, sep, rest = text.partition("://")
    if sep and "=" in head:
        name, text = text.split("=", 1)
    parts = text.split(",")
    pub, opts = parts[0], parts[1:]
    positional = 0
    forwarded = False
    for o in opts:
        key, eq, value = o.partition("=")
        if eq and "://" not in key:
            if key not in ("replay", "name", "forwarded") or not value:
                raise ValueError(f"bad option {o!r} in {text!r}; expected {SYNTAX}")
            if key == "replay":
                replay = value
            elif key == "forwarded":
                forwarded = parse_forwarded(value, text)
            else:
                name = value
        elif "://" in o and positional == 0:
            replay, positional = o, 1
        else:
            raise ValueError(f"unexpected {o!r} in {text!r}; expected {SYNTAX}")
    # --replay/--name pair with the ENDPOINT in the same position: one that meets an
    # endpoint naming its own is a misplaced flag, not a default to override silently.
    if flag_replay is not None and replay != flag_replay:
        raise ValueError(f"{pub!r} gets two replay endpoints ({replay!r} in the endpoint, {flag_replay!r} "
                         "from --replay); --replay pairs with the ENDPOINT in the same position, so give "
                         "each endpoint its own, e.g. tcp://h:5557,replay=tcp://h:5558")
    if flag_name is not None and name != flag_name:
        raise ValueError(f"{pub!r} gets two names ({name!r} in the endpoint, {flag_name!r} from --name); "
                         "--name pairs with the ENDPOINT in the same position")
    if "://" not in pub:
        raise ValueError(f"{pub!r} is not an endpoint; write it as tcp://HOST:PORT (expected {SYNTAX})")
    if name == "":
        raise ValueError(f"empty source name in {text!r}")
    return SourceSpec(pub, replay or None, name or None, forwarded=forwarded)


_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _split(endpoint: str, what: str) -> tuple[str, str] | None:
    """``(host, port)`` of a tcp endpoint (None for ipc/inproc); ValueError for anything
    that ZMQ would not take."""
    if not endpoint.startswith(_SCHEMES):
        scheme = endpoint.split("://", 1)[0] if "://" in endpoint else endpoint
        raise ValueError(f"{what} {endpoint!r}: scheme {scheme!r} is not supported; KV event streams use "
                         "tcp://HOST:PORT, or ipc:///PATH (not http://)")
    if not endpoint.startswith("tcp://"):
        if len(endpoint.split("://", 1)[1]) == 0:
            raise ValueError(f"{what} {endpoint!r} has no path")
        if endpoint.startswith("inproc://"):
            # inproc reaches sockets of the same process only; a command's peers are other processes.
            raise ValueError(f"{what} {endpoint!r}: inproc:// only reaches sockets inside one process, and "
                             "the peers of this command are other processes; use ipc:///PATH or tcp://HOST:PORT")
        return None
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "]" in port:
        raise ValueError(f"{what} {endpoint!r} has no port; write it as tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557")
    return host, port


def check_connect_endpoint(endpoint: str, what: str = "endpoint") -> None:
    """Check an endpoint a subscriber connects to: tcp://HOST:PORT with a real host
    (resolvable) and a port in 1..65535, or ipc/inproc. Raises ``ValueError`` naming the
    problem and the fix. A ``nats://`` URL (a JetStream source) is checked by
    :func:`kvstream.jetstream.parse_nats_url` instead."""
    if endpoint.startswith("nats://"):
        from kvstream.jetstream.config import parse_nats_url

        parse_nats_url(endpoint)  # JetStreamConfigError is a ValueError
        return
    hp = _split(endpoint, what)
    if hp is None:
        return
    host, port = hp
    if host in ("*", "0.0.0.0", "[::]", "::"):
        raise ValueError(f"{what} {endpoint!r} is a bind address (all interfaces); a subscriber connects to "
                         f"the publisher's host, e.g. tcp://127.0.0.1:{port}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {endpoint!r}: port {port!r} is not a port number (1-65535)")
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    import socket

    try:
        socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"{what} {endpoint!r}: cannot resolve host {name!r} ({exc.args[-1]})") from None


def check_bind_endpoint(endpoint: str, what: str = "endpoint") -> None:
    """Check an endpoint a server binds: tcp://HOST:PORT (HOST may be ``*``; PORT 0..65535
    or ``*`` for any free port), or ipc/inproc. Raises ``ValueError`` naming the problem."""
    hp = _split(endpoint, what)
    if hp is None:
        return
    _, port = hp
    if port != "*" and (not port.isdigit() or not 0 <= int(port) <= 65535):
        raise ValueError(f"{what} {endpoint!r}: port {port!r} is not a port number (0-65535, or * for any)")


def check_distinct_bind_endpoints(specs: "list[SourceSpec]", what: str = "endpoint") -> None:
    """Every endpoint a command binds (PUB and replay, over all ``specs``) is bound once:
    a fixed tcp port or ipc path given twice cannot be bound twice. Raises ``ValueError``."""
    seen: dict[str, str] = {}
    for spec in specs:
        for ep in (spec.endpoint, spec.replay_endpoint):
            if not ep or ep.endswith((":0", ":*")):
                continue
            if ep in seen:
                raise ValueError(f"{what} {ep!r} is given twice ({seen[ep]} and {spec.endpoint}); every PUB and "
                                 "replay endpoint needs its own port or path")
            seen[ep] = spec.endpoint
    return None


def add_curve_client_args(p: argparse.ArgumentParser) -> None:
    """``--curve-server-key`` / ``--curve-cert``: CURVE for subscribing commands."""
    p.add_argument("--curve-server-key", metavar="FILE",
                   help="publisher's public certificate (zmq.auth .key file): enables CURVE")
    p.add_argument("--curve-cert", metavar="FILE",
                   help="this subscriber's secret certificate (.key_secret); default: a fresh keypair")


def curve_client_from_args(args: argparse.Namespace) -> CurveClientConfig | None:
    """The CURVE client settings the flags ask for (None: CURVE off). Raises ``ValueError``
    for an inconsistent or unreadable pair of files."""
    if not args.curve_server_key:
        if args.curve_cert:
            raise ValueError("--curve-cert needs --curve-server-key (the publisher's public certificate)")
        return None
    from kvstream.transport.curve import generate_keypair, read_keypair

    server, _ = read_keypair(args.curve_server_key)
    if args.curve_cert:
        public, secret = read_keypair(args.curve_cert)
        if secret is None:
            raise ValueError(f"{args.curve_cert} holds no secret key (use the .key_secret file)")
    else:
        public, secret = generate_keypair()
    return CurveClientConfig(server_public_key=server, secret_key=secret, public_key=public)
