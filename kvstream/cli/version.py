"""``kvstream version`` (also ``kvstream --version``): kvstream's version and its
dependencies' versions."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print kvstream's version and its dependencies' versions")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvstream.cli._common import version_lines

    print("\n".join(version_lines()))
    return 0
