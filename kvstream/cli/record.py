"""``kvstream record ENDPOINT... -o LOG``: record live KV event streams into an event log."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any


from kvstream.cli._common import CLIError, add_log_level, positive_float, positive_int
from kvstream.cli._endpoints import add_curve_client_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "record",
        help="subscribe to engines (with gap recovery) and write everything into an event log",
        description=(
            "Subscribe to one or more KV event publishers and record every message and every "
            "recovery event (reset/stale/live) into an event log until SIGINT/SIGTERM, "
            "--duration or --max-batches. ENDPOINT is PUB or PUB,REPLAY, optionally "
            "prefixed with NAME= (e.g. e0=tcp://h:5557,tcp://h:5558); the source name "
            "defaults to the PUB endpoint, or with --append to the name the log already "
            "records that endpoint under. On a terminal a status line is redrawn in place "
            "every 0.5 s; into a file or pipe one status line is written every 10 s."
        ),
    )
    p.add_argument("endpoints", nargs="+", metavar="ENDPOINT")
    p.add_argument("-o", "--output", required=True, metavar="LOG", help="log file (or directory with rotation)")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--flush", choices=("record", "interval", "close"), default="interval",
                   help="flush policy (default: interval)")
    p.add_argument("--flush-interval-ms", type=positive_float, default=50.0, help="interval flush period, ms (default 50)")
    p.add_argument("--fsync", action="store_true", help="fsync on every flush (survive power loss)")
    p.add_argument("--rotate-mb", type=positive_float, help="start a new segment after this many MB")
    p.add_argument("--rotate-s", type=positive_float, help="start a new segment after this many seconds")
    p.add_argument("--zstd", action="store_true", help="compress segments with zstd (needs kvstream[zstd])")
    p.add_argument("--append", action="store_true",
                   help="append to an existing log: damaged bytes are moved to a .damaged file (never "
                        "deleted), and batches the log already holds are not recorded again")
    p.add_argument("--duration", type=positive_float, metavar="SECONDS", help="stop after this many seconds")
    p.add_argument("--max-batches", type=positive_int, metavar="N", help="stop after N batches")
    p.add_argument("--quiet", action="store_true", help="no live status line")
    add_curve_client_args(p)
    add_log_level(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.cli._endpoints import check_connect_endpoint, curve_client_from_args, parse_source
    from kvstream.errors import KVStreamError, LocalProtocolError
    from kvstream.eventlog.writer import LogWriter

    try:
        # What the command line says is checked first (exit status 2), the log after (1).
        specs = [parse_source(e) for e in args.endpoints]
        for spec in specs:
            check_connect_endpoint(spec.endpoint, "endpoint")
            if spec.replay_endpoint:
                check_connect_endpoint(spec.replay_endpoint, "replay endpoint")
        args.curve = curve_client_from_args(args)
    except (ValueError, OSError, KVStreamError) as exc:
        raise CLIError(str(exc)) from None
    if args.append:
        specs = names_from_log(args.output, specs)
    try:
        writer = LogWriter(
            args.output,
            metadata={"endpoints": [[s.source, s.endpoint, s.replay_endpoint] for s in specs],
                      "topic": args.topic, "recorder": "kvstream record"},
            flush=args.flush, flush_interval=args.flush_interval_ms / 1000.0, fsync=args.fsync,
            rotate_bytes=int(args.rotate_mb * 1e6) if args.rotate_mb else None,
            rotate_seconds=args.rotate_s, compression="zstd" if args.zstd else None, resume=args.append,
        )
    except (ValueError, FileExistsError, OSError, KVStreamError) as exc:
        print(f"kvstream record: {exc}", file=sys.stderr)
        return 1
    for dmg in writer.recovered:
        print(f"kvstream record: damage in the log being appended to: {dmg}", file=sys.stderr)
    try:
        try:
            stats, resume, states = anyio.run(_record, args, specs, writer)
        finally:
            writer.close()
    except LocalProtocolError as exc:  # e.g. no NATS server at a nats:// URL
        print(f"kvstream record: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the log cannot be written (disk full, file too large)
        print(f"kvstream record: writing {args.output} failed: {exc.strerror or exc}; the log keeps every "
              f"record written before (a complete record ends it; `kvstream inspect {args.output}`)",
              file=sys.stderr)
        return 1
    end = "\n" if _redraws(args) else ""  # ends the status line drawn in place
    print(f"{end}recorded {status_line(stats, states)}  ({writer.bytes_written} bytes) into {args.output}",
          file=sys.stderr)
    if resume is not None and (resume.skipped or resume.restarts or resume.gaps):
        print(f"kvstream record: appended: {resume.skipped} batch(es) the log already held were not recorded "
              f"again; {resume.restarts} engine restart(s) and {resume.gaps} unrecorded gap(s) since the log "
              "ended were marked", file=sys.stderr)
    return 0


async def _record(args: argparse.Namespace, specs, writer):
    import signal

    import anyio

    from kvstream.eventlog.recorder import Recorder
    from kvstream.jetstream import open_subscriber  # ZMQ, or JetStream for nats:// URLs

    async with open_subscriber(specs, topic=args.topic, curve=args.curve) as sub:
        rec = Recorder(sub, writer)
        async with anyio.create_task_group() as tg:

            async def signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                    async for _ in received:
                        rec.stop()
                        return

            async def status() -> None:
                t0 = time.monotonic()
                redraw = _redraws(args)
                every = 0.5 if redraw else LOG_STATUS_S
                last = t0
                while True:
                    await anyio.sleep(0.5)
                    now = time.monotonic()
                    if not args.quiet and now - last >= every - 0.01:
                        last = now
                        line = f"{now - t0:7.1f}s  {status_line(rec.stats, _states(sub))}"
                        # \r redraws the line on a terminal; a log file gets whole lines.
                        sys.stderr.write(f"\r{line}   " if redraw else f"kvstream record: {line.strip()}\n")
                        sys.stderr.flush()
                    if args.duration is not None and now - t0 >= args.duration:
                        rec.stop()

            tg.start_soon(signals)
            tg.start_soon(status)
            await rec.run(max_batches=args.max_batches)
            tg.cancel_scope.cancel()
        states = _states(sub)
    return rec.stats, rec.resume, states


LOG_STATUS_S = 10.0
"""Seconds between status lines when stderr is not a terminal."""


def _redraws(args: argparse.Namespace) -> bool:
    """Whether the status line is redrawn in place (stderr is a terminal)."""
    return not args.quiet and sys.stderr.isatty()


def _states(sub: Any) -> Counter[str]:
    """How many sources are in each state right now."""
    return Counter(h.state for h in sub.health().values())


def status_line(stats: Any, states: Counter[str]) -> str:
    """What a recording holds so far: batches, the sources by their current state (not
    by how often they changed it), and the recovery notices recorded."""
    by_state = ", ".join(f"{n} {s}" for s, n in sorted(states.items(), key=lambda kv: _STATE_ORDER.get(kv[0], 9)))
    line = f"batches {stats.batches}  sources {sum(states.values())}" + (f" ({by_state})" if by_state else "")
    notices = []
    for kind, n in sorted(stats.controls.items()):
        if kind == "live":
            notices.append(f"recovered {n}")  # back to live after a reset or a stale mark
        elif kind == "stale":
            notices.append(f"stale marks {n}")
        else:
            notices.append(f"{kind.replace('/', ' ')} {n}")  # e.g. "reset restart 1"
    return line + (f"  notices: {', '.join(notices)}" if notices else "")


_STATE_ORDER = {"live": 0, "recovering": 1, "connecting": 2, "stale": 3}


def names_from_log(path: str, specs: list[Any]) -> list[Any]:
    """With ``--append``: an endpoint given without ``NAME=`` takes the name the log already
    records it under (its header's ``endpoints``), so one engine stays one source; one
    given a NAME= other than the log's gets a warning line. The specs unchanged when the
    log is new or holds no endpoint list."""
    import dataclasses
    import os

    from kvstream.eventlog.reader import LogReader

    if not os.path.exists(path):
        return specs
    try:
        recorded = LogReader(path).metadata.get("endpoints") or []
        names = {str(e[1]): str(e[0]) for e in recorded if isinstance(e, list) and len(e) >= 2}
    except Exception:  # noqa: BLE001 - a damaged log: the writer reports it; names stay as given
        return specs
    out = []
    for spec in specs:
        old = names.get(spec.endpoint)
        if old is not None and spec.name is None and old != spec.endpoint:
            print(f"kvstream record: {spec.endpoint} keeps its name {old!r} from {path}", file=sys.stderr)
            spec = dataclasses.replace(spec, name=old)
        elif old is not None and spec.name is not None and spec.name != old:
            print(f"kvstream record: warning: {path} records {spec.endpoint} as {old!r}; as {spec.name!r} its "
                  "batches start a second source (drop NAME= to keep one)", file=sys.stderr)
        out.append(spec)
    return out
