"""What every sub-command shares: one-line errors, checked numeric flags, output paths,
``--log-level``, the hash display format, and the versions ``--version`` prints.

Bad input on the command line gets one line on stderr naming the problem and a non-zero
exit, before any work starts.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from kvstream.eventlog.summary import format_hash

__all__ = [
    "CLIParser",
    "plain_text",
    "CLIError",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "non_negative_float",
    "check_output_path",
    "add_log_level",
    "configure_logging",
    "add_hash_format",
    "format_hash",
    "version_lines",
    "LOG_LEVELS",
    "fraction",
    "port_number",
    "exception_leaves",
    "quiet_stdout",
    "os_error_line",
    "check_block_memory",
    "BYTES_PER_BLOCK",
    "add_deprecated_alias",
]

LOG_LEVELS = ("debug", "info", "warning", "error")


class CLIError(Exception):
    """A problem with what the user asked for: printed as ``kvstream CMD: message``,
    exit status 2."""


def plain_text(doc: str) -> str:
    """A module docstring (reStructuredText) as ``--help`` shows it: ``code`` and
    :role:`~pkg.Name` markup reduced to the text, a ``::`` literal-block marker to ``:``.
    What is inside a literal block (indented examples) is kept as written."""
    import re

    lines = []
    for line in doc.splitlines():
        if line.strip() == "::":
            continue  # the marker alone: the example block follows the previous paragraph
        lines.append(line[:-1] if line.endswith("::") else line)
    text = "\n".join(lines)  # inline markup may run over a line break
    text = re.sub(r":[a-z]+:`~?([^`<]*?)\s*<[^`>]*>`", r"\1", text)  # :ref:`text <target>`
    text = re.sub(r":[a-z]+:`~([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = re.sub(r":[a-z]+:`([^`]*)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)


class CLIParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look)
    instead of a usage block, with exit status 2. Its description and epilog are shown
    as plain text (:func:`plain_text`), so docstrings can serve as both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in ("description", "epilog"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = plain_text(kwargs[key])
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _DeprecatedAlias(argparse.Action):
    """An old spelling of another option: parsed exactly as that option (same type, choices
    and number of values, into the same ``dest``), with one warning line on stderr naming
    the spelling to use. Hidden from ``--help``."""

    def __init__(self, option_strings: list[str], dest: str, *, target: argparse.Action, **_: Any) -> None:
        kind: Any = target.type  # typeshed allows a registered type's name here too
        super().__init__(option_strings, target.dest, nargs=target.nargs, const=target.const,
                         default=argparse.SUPPRESS, type=kind, choices=target.choices,
                         metavar=target.metavar, help=argparse.SUPPRESS)
        self.target = target

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        new = max(self.target.option_strings, key=len)
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {new} (same meaning)",
              file=sys.stderr)
        self.target(parser, namespace, values, new)


def add_deprecated_alias(group: Any, target: argparse.Action, *old: str) -> None:
    """Keep ``old`` spellings of the option ``target`` (what ``add_argument`` returned)
    working, as deprecated aliases: same values, one warning line when used, hidden from
    ``--help``. ``group`` is the parser or argument group ``target`` belongs to."""
    group.add_argument(*old, action=_DeprecatedAlias, target=target, dest=target.dest)


def _number(kind: Callable[[str], Any], test: Callable[[Any], bool], want: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {want}") from None
        if not test(v):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return v

    parse.__name__ = want  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
"""argparse type: an integer >= 1."""
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
"""argparse type: an integer >= 0."""
positive_float = _number(float, lambda v: v > 0 and v != float("inf"), "a positive number")
"""argparse type: a finite number > 0."""
non_negative_float = _number(float, lambda v: v >= 0 and v != float("inf"), "a number >= 0")
"""argparse type: a finite number >= 0."""
fraction = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
"""argparse type: a number in (0, 1]."""
port_number = _number(int, lambda v: 0 <= v <= 65535, "a port number 0..65535 (0: any free port)")
"""argparse type: a TCP port, 0 for any free one."""


def check_output_path(path: str | os.PathLike[str], flag: str, *, suffixes: tuple[str, ...] = ()) -> Path:
    """Check, before any work, that a file can be written at ``path`` (for option
    ``flag``): its folder exists and is writable, it is not a folder, and its suffix is
    one of ``suffixes`` (if given). Raises :class:`CLIError` saying what to fix."""
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"{flag} {str(path)!r} is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"{flag} {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise CLIError(f"{flag} {str(path)!r}: directory {str(parent)!r} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise CLIError(f"{flag} {str(path)!r} exists and is not writable")
    if suffixes and p.suffix.lower() not in suffixes:
        raise CLIError(f"{flag} {str(path)!r}: the file name must end in {' or '.join(suffixes)}")
    return p


def add_log_level(p: argparse.ArgumentParser) -> None:
    """``--log-level``: what a long-running command logs on stderr."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                   help="log messages of this level and above on stderr (default warning)")


def configure_logging(level: str | None, fmt: str = "text") -> None:
    """Send kvstream's log records of ``level`` and above to stderr, one line each (``fmt``
    ``text`` or ``json``). One setup for every command (:func:`kvstream.service.logs.setup_logging`):
    only kvstream's and the HTTP server's loggers, so other libraries' debug output stays out."""
    if level is None:
        return
    from kvstream.service.logs import setup_logging

    setup_logging(fmt, level)


def add_hash_format(p: argparse.ArgumentParser) -> None:
    """``--hash-format``: how block hashes are shown (the same in every command)."""
    p.add_argument("--hash-format", choices=("hex", "int"), default="hex",
                   help="block hashes as hex (default; 16 digits for 64-bit hashes, all bytes for "
                        "byte hashes) or as unsigned integers")


def version_lines() -> list[str]:
    """kvstream's version and every dependency's (required, then optional with the extra
    that brings it), one per line, as the installed package's metadata declares them."""
    import re
    from importlib import metadata

    import kvstream

    lines = [f"kvstream {kvstream.__version__} (Python {sys.version.split()[0]})"]
    try:
        reqs = metadata.requires("kvstream") or []
    except metadata.PackageNotFoundError:
        reqs = ["anyio", "msgspec", "pyzmq", "cbor2", "xxhash"]
    seen: dict[str, str] = {}
    for req in reqs:
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", req)
        if extra is not None and extra.group(1) == "test":
            continue
        if name not in seen:
            seen[name] = f" (optional: kvstream[{extra.group(1)}])" if extra else ""
    for name, note in seen.items():
        try:
            v = metadata.version(name)
        except metadata.PackageNotFoundError:
            v = "not installed"
        if name == "pyzmq" and v != "not installed":
            import zmq

            v += f" (libzmq {zmq.zmq_version()})"
        lines.append(f"  {name} {v}{note}")
    return lines


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[exc]``."""
    inner = getattr(exc, "exceptions", None)
    if not isinstance(inner, tuple):
        return [exc]
    return [leaf for e in inner for leaf in exception_leaves(e)]


def quiet_stdout() -> None:
    """Point stdout at /dev/null: its reader went away (``kvstream ... | head``), and the
    interpreter's last flush must not print a BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def os_error_line(exc: OSError) -> str:
    """One line for an :class:`OSError` a command cannot recover from: the path (if any),
    what the system said, and for stdout a hint that the output went nowhere."""
    what = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {what}"
    return f"cannot write the output: {what}" if exc.errno in (errno.ENOSPC, errno.EIO, errno.EFBIG) else what


BYTES_PER_BLOCK = 160
"""Memory one KV block of a block pool takes in this process (bytes; measured: 2,000
simulated engines x 2,048 blocks peak at 0.66 GB RSS, an emulated engine of 10 million
blocks at 1.7 GB)."""


def check_block_memory(blocks: int, what: str, fix: str) -> None:
    """Before any work: refuse ``blocks`` pool blocks (``what`` says whose) that cannot fit
    in this machine's memory at :data:`BYTES_PER_BLOCK` each; they would swap the machine
    to a halt or be killed after minutes. ``fix`` says what to lower. Raises
    :class:`CLIError`."""
    need = blocks * BYTES_PER_BLOCK
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return  # not knowable here (not POSIX): let it run
    if need > total:
        raise CLIError(f"{what} would need about {need / 2**30:.0f} GiB of memory, more than this machine's "
                       f"{total / 2**30:.0f} GiB; {fix}")


PARENT_FD_ENV = "KVSTREAM_PARENT_FD"
"""Set by :mod:`kvstream.emulator.launch` in the processes it starts: the number of an
inherited pipe's read end whose write end only the launching process holds."""


def exit_with_parent() -> None:
    """If this process was started by :mod:`kvstream.emulator.launch`, end it (SIGTERM to
    itself, so it shuts down as on ``kill``) when the process that launched it is gone, even
    if that one was SIGKILLed: the launcher holds the pipe's only write end, and its death
    closes it. A no-op when the variable is absent or not an open pipe."""
    import signal
    import stat
    import threading

    value = os.environ.pop(PARENT_FD_ENV, None)  # not for the processes this one starts
    if value is None:
        return
    try:
        fd = int(value)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
    except (ValueError, OSError):
        return

    def watch() -> None:
        try:
            while os.read(fd, 64):  # the launcher never writes; EOF means it is gone
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    # A watchdog for the process's whole life (nothing to join: it ends with the process).
    threading.Thread(target=watch, name="kvstream-parent-watch", daemon=True).start()
