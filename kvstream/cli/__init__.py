"""The ``kvstream`` command line: one sub-command per module in this package.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code).
The dispatcher imports a module only to register it, so a slow import in one command does
not slow the others more than needed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main", "build_parser"]

# Order is the order `kvstream --help` lists them in.
_COMMANDS: tuple[str, ...] = (
    "demo", "simulate", "plan", "subscribe", "record", "relay", "inspect", "replay", "convert", "version",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="kvstream",
        description=(
            "KV cache tooling for LLM serving engines: a vLLM-compatible prefix-caching "
            "allocator, the KV event stream, a prefix-aware router index, event logs, "
            "planning and a routing simulator."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"kvstream.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstream`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvstream ... | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
