"""``kvstream version``: print the package version and the versions of its wire stack."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print kvstream's version and its dependencies' versions")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import msgspec
    import zmq

    import kvstream

    print(f"kvstream {kvstream.__version__}")
    print(f"msgspec {msgspec.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})")
    return 0
