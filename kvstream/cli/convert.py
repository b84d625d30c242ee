"""``kvstream convert CAPTURE... -o LOG``: turn KVSTRM01 wire captures into an event log."""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert KVSTRM01 wire captures (e.g. the golden vLLM captures) into an event log",
        description=(
            "Write the messages of one or more KVSTRM01 captures into a new event log, as a "
            "subscriber would have recorded them (live messages, plus replay replies never "
            "seen live). recv times are the batches' own ts."
        ),
    )
    p.add_argument("captures", nargs="+", metavar="CAPTURE")
    p.add_argument("-o", "--output", required=True, metavar="LOG", help="the event log to create")
    p.add_argument("--source", action="append", metavar="NAME",
                   help="source name of each capture, in order (default: the file name)")
    p.add_argument("--zstd", action="store_true", help="compress segments with zstd (needs kvstream[zstd])")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvstream.cli._common import CLIError, check_output_path, os_error_line
    from kvstream.eventlog.convert import convert_captures
    from kvstream.wire.capture import CaptureFormatError
    from kvstream.wire.framing import FrameError

    check_output_path(args.output, "-o")  # before reading anything (exit status 2)
    for c in args.captures:
        if os.path.isdir(c):
            raise CLIError(f"{c!r} is a directory; give KVSTRM01 capture files")
    existed = os.path.lexists(args.output)
    try:
        n = convert_captures(args.captures, args.output, sources=args.source,
                             compression="zstd" if args.zstd else None)
    except (CaptureFormatError, FrameError, FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"kvstream convert: {exc}", file=sys.stderr)
        return 1
    except (OSError, KeyboardInterrupt) as exc:
        # A log cut short by a full disk or Ctrl-C is not the conversion: do not leave it
        # under the name of the finished one (a rerun would find it "already exists").
        if not existed and os.path.isfile(args.output):
            os.remove(args.output)
        if isinstance(exc, KeyboardInterrupt):
            raise
        print(f"kvstream convert: {os_error_line(exc)}; nothing was kept", file=sys.stderr)
        return 1
    print(f"wrote {n} records to {args.output}")
    return 0
