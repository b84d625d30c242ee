"""What every command that follows engines shares: the endpoint syntax and CURVE flags.

``[NAME=]PUB[,REPLAY]`` with optional ``,replay=ENDPOINT`` and ``,name=NAME`` options, e.g.
``e0=tcp://h:5557,tcp://h:5558`` or ``tcp://h:5557,replay=tcp://h:5558,name=e0``.
"""

from __future__ import annotations

import argparse

from kvstream.transport import CurveClientConfig, SourceSpec

__all__ = ["parse_source", "SYNTAX", "add_curve_client_args", "curve_client_from_args"]

SYNTAX = "[NAME=]PUB[,REPLAY] (or PUB,replay=REPLAY,name=NAME), e.g. e0=tcp://h:5557,tcp://h:5558"


def parse_source(text: str, replay: str | None = None, name: str | None = None) -> SourceSpec:
    """Parse one endpoint argument into a :class:`SourceSpec`; ``replay``/``name`` are
    defaults (from separate flags) that the text may override. Raises ``ValueError``
    saying what is wrong and the accepted syntax."""
    head, sep, rest = text.partition("://")
    if sep and "=" in head:
        name, text = text.split("=", 1)
    parts = text.split(",")
    pub, opts = parts[0], parts[1:]
    positional = 0
    for o in opts:
        key, eq, value = o.partition("=")
        if eq and "://" not in key:
            if key not in ("replay", "name") or not value:
                raise ValueError(f"bad option {o!r} in {text!r}; expected {SYNTAX}")
            if key == "replay":
                replay = value
            else:
                name = value
        elif "://" in o and positional == 0:
            replay, positional = o, 1
        else:
            raise ValueError(f"unexpected {o!r} in {text!r}; expected {SYNTAX}")
    if "://" not in pub:
        raise ValueError(f"{pub!r} is not an endpoint; write it as tcp://HOST:PORT (expected {SYNTAX})")
    if name == "":
        raise ValueError(f"empty source name in {text!r}")
    return SourceSpec(pub, replay or None, name or None)


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
