"""The ``kvstream`` command line: one sub-command per module in this package.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an exit code).
The dispatcher imports a module only to register it, so a slow import in one command does
not slow the others more than needed.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Any, Sequence

__all__ = ["main", "build_parser"]

# Order is the order `kvstream --help` lists them in.
_COMMANDS: tuple[str, ...] = (
    "demo", "serve", "engine", "simulate", "plan", "subscribe", "record", "relay", "inspect", "replay", "convert", "version",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every sub-command registered."""
    from kvstream.cli._common import CLIParser

    parser = CLIParser(
        prog="kvstream",
        description=(
            "KV cache tooling for LLM serving engines: a vLLM-compatible prefix-caching "
            "allocator, the KV event stream, a prefix-aware router index, event logs, "
            "planning and a routing simulator."
        ),
    )
    parser.add_argument("--version", action="store_true",
                        help="print kvstream's version and its dependencies' versions, then exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CLIParser)
    for name in _COMMANDS:
        module = importlib.import_module(f"kvstream.cli.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstream`` console script; returns the process exit code.

    Ctrl-C at any point (while the parser imports the commands, too) is one line,
    ``kvstream CMD: interrupted``, and exit status 130."""
    _keep_interrupts()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print(f"{_command_name(argv)}: interrupted", file=sys.stderr)
        return 130


def _keep_interrupts() -> None:
    """Take back a Ctrl-C that Python would lose. One that lands in code Python cannot raise
    from (a weakref callback of the import system, a ``__del__``) is printed as "Exception
    ignored in ..." with a traceback, and then the command runs on as if no Ctrl-C had come.
    This hook prints nothing for it and sends SIGINT to the main thread again, from a timer
    thread a few milliseconds later: by then the hook has returned (an interrupt raised in
    the hook itself would be lost the same way), and it lands where Python can raise it, as
    the one-line ``interrupted`` of :func:`main`. Should it land in such a place again, the
    hook sends it again."""
    previous = sys.unraisablehook
    main_thread = threading.main_thread().ident
    assert main_thread is not None

    def hook(unraisable: Any) -> None:
        exc_type = unraisable.exc_type
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            resend = threading.Timer(0.005, signal.pthread_kill, (main_thread, signal.SIGINT))
            resend.daemon = True
            resend.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook


def _command_name(argv: Sequence[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args if not a.startswith("-")), None)
    return f"kvstream {first}" if first in _COMMANDS else "kvstream"


def _main(argv: Sequence[str] | None) -> int:
    from kvstream.cli._common import (
        CLIError,
        configure_logging,
        exception_leaves,
        exit_with_parent,
        os_error_line,
        quiet_stdout,
        version_lines,
    )

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Said by the sub-command's own parser, so the message points at its --help.
        _subparser(parser, getattr(args, "command", None)).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.version:
        print("\n".join(version_lines()))
        return 0
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    configure_logging(getattr(args, "log_level", None), getattr(args, "log_format", None) or "text")
    exit_with_parent()
    name = f"kvstream {args.command}"
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not at interpreter exit
        return code
    except CLIError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvstream ... | head`
        quiet_stdout()
        return 0
    except OSError as exc:  # a file or stdout that cannot be written (full disk, read-only place)
        _drop_stdout_if_broken()
        print(f"{name}: {os_error_line(exc)}", file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - exception groups from task groups
        leaves = exception_leaves(exc)
        if leaves == [exc]:
            raise
        if all(isinstance(e, BrokenPipeError) for e in leaves):
            quiet_stdout()
            return 0
        if all(isinstance(e, KeyboardInterrupt) for e in leaves):
            print(f"{name}: interrupted", file=sys.stderr)
            return 130
        if all(isinstance(e, (OSError, CLIError)) for e in leaves):
            _drop_stdout_if_broken()
            first = leaves[0]
            print(f"{name}: {os_error_line(first) if isinstance(first, OSError) else first}", file=sys.stderr)
            return 1 if isinstance(first, OSError) else 2
        raise


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of sub-command ``command`` (the top-level one when there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return parser


def _drop_stdout_if_broken() -> None:
    """After an OSError: if stdout itself cannot be written, point it at /dev/null so the
    interpreter's last flush does not print a second error."""
    from kvstream.cli._common import quiet_stdout

    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        quiet_stdout()
