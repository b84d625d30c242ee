"""``kvstream inspect LOG``: summarise an event log (or a KVSTRM01 capture), or list its events."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable

from kvstream.cli._common import CLIError, add_hash_format, non_negative_float, os_error_line

_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared", "reset", "stale", "live", "undecodable")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise an event log (sources, seq ranges, gaps, restarts, event counts) or list its events",
        description=(
            "Summarise an event log written by `kvstream record` (a file or a directory of "
            "segments). A KVSTRM01 wire capture is accepted too and read as the log it "
            "converts to. Exit status 3 means the log is damaged (the intact part is still shown)."
        ),
    )
    p.add_argument("log", help="event log file or directory, or a KVSTRM01 capture")
    p.add_argument("--events", action="store_true", help="print every event instead of the summary")
    p.add_argument("--json", action="store_true", help="JSON output (summary: one object; --events: JSON lines)")
    p.add_argument("--source", action="append", metavar="NAME", help="only this source (repeatable)")
    p.add_argument("--type", action="append", metavar="TYPE", choices=_TYPES,
                   help=f"only this event type (repeatable): {', '.join(_TYPES)}")
    p.add_argument("--since", type=non_negative_float, metavar="SECONDS",
                   help="only records received at least SECONDS after the log's first record")
    p.add_argument("--until", type=non_negative_float, metavar="SECONDS",
                   help="only records received at most SECONDS after the log's first record")
    add_hash_format(p)
    p.set_defaults(func=_run)


def _records(path: str) -> tuple[Iterable[Any], Any]:
    from kvstream.eventlog.convert import capture_records, is_capture
    from kvstream.eventlog.reader import LogReader

    if is_capture(path):
        from pathlib import Path

        return capture_records(path, Path(path).name), None
    reader = LogReader(path)
    return reader, reader


def _run(args: argparse.Namespace) -> int:
    import msgspec

    from kvstream.eventlog.format import LogControl, LogFormatError
    from kvstream.eventlog.summary import LogSummary, event_rows

    # What the command line says is checked before the log is read (exit status 2).
    if args.type and not args.events:
        raise CLIError("--type filters --events output only; add --events (the summary counts every type)")
    if args.since is not None and args.until is not None and args.since > args.until:
        raise CLIError(f"--since {args.since:g} is after --until {args.until:g}: no record can match")
    try:
        records, reader = _records(args.log)
        seen: set[str] = set()
        first_ns: int | None = None
        sources = set(args.source) if args.source else None
        types = set(args.type) if args.type else None
        summary = LogSummary()
        out = sys.stdout
        enc = msgspec.json.Encoder()
        for rec in records:
            if first_ns is None:
                first_ns = rec.recv_ns
            rel = (rec.recv_ns - first_ns) / 1e9
            seen.add(rec.source)
            if args.since is not None and rel < args.since:
                continue
            if args.until is not None and rel > args.until:
                continue
            if sources is not None and rec.source not in sources:
                continue
            if not args.events:
                if types is None:
                    summary.add(rec)
                continue
            batch = summary.add(rec) if type(rec) is not LogControl else None
            for row in event_rows(rec, batch, args.hash_format):
                if types is not None and row["type"] not in types:
                    continue
                if args.json:
                    out.write(enc.encode(row).decode() + "\n")
                else:
                    out.write(_human(row, rel) + "\n")
        if sources is not None and not sources & seen:
            raise CLIError(f"no source {' or '.join(sorted(sources))} in {args.log}; its sources: "
                           f"{', '.join(sorted(seen)) or '(none)'}")
        if not args.events:
            d = summary.as_dict()
            if reader is not None:
                d["metadata"] = reader.metadata
                d["damage"] = [msgspec.structs.asdict(x) for x in reader.damage]
            if args.json:
                out.write(enc.encode(d).decode() + "\n")
            else:
                _print_summary(d, out)
    except (LogFormatError, ValueError) as exc:
        print(f"kvstream inspect: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.filename is None:
            raise  # stdout: the dispatcher reports it (a closed pipe is not an error)
        print(f"kvstream inspect: {os_error_line(exc)}", file=sys.stderr)
        return 1
    damage = reader.damage if reader is not None else []
    for dm in damage:
        print(f"kvstream inspect: DAMAGED: {dm}", file=sys.stderr)
    return 3 if damage else 0


def _human(row: dict[str, Any], rel: float) -> str:
    t = row["type"]
    head = f"{rel:+12.6f}s {row['source']}"
    if t in ("reset", "stale", "live"):
        if t == "stale":
            return f"{head} -- {t} missing {row['first_missing_seq']}..{row['resume_seq']} ({row['reason']})"
        return f"{head} -- {t} seq={row['seq']}" + (f" ({row['reason']})" if row["reason"] else "")
    head += f" #{row['seq']}" + (" R" if row.get("replayed") else "")
    if t == "undecodable":
        return f"{head} undecodable payload ({row['payload_len']} bytes)"
    if t == "AllBlocksCleared":
        return f"{head} AllBlocksCleared"
    hashes = row["block_hashes"]
    shown = ",".join(_short(h) for h in hashes[:4]) + (",..." if len(hashes) > 4 else "")
    extra = ""
    if t == "BlockStored":
        parent = row["parent_block_hash"]
        extra = f" parent={_short(parent) if parent is not None else '-'} tokens={row['num_tokens']}"
        if row["lora_name"] or row["lora_id"] is not None:
            extra += f" lora={row['lora_name'] or row['lora_id']}"
    return f"{head} {t} {row['medium'] or '-'} n={len(hashes)} [{shown}]{extra}"


def _short(h: Any) -> str:
    # The same short form as `kvstream subscribe`: 16 hex digits (ints stay whole).
    return h[:16] if isinstance(h, str) else str(h)


def _print_summary(d: dict[str, Any], out: Any) -> None:
    w = out.write
    w(f"records: {d['records']}   span: {d['span_s']:.3f} s\n")
    if d.get("metadata"):
        import json

        w(f"metadata: {json.dumps(d['metadata'], sort_keys=True)}\n")
    for s in d["sources"]:
        w(f"\nsource {s['source']}  (topics: {', '.join(s['topics']) or '-'})\n")
        runs = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in s["seq_runs"][:8])
        if len(s["seq_runs"]) > 8:
            runs += f", ... ({len(s['seq_runs'])} runs)"
        w(f"  batches: {s['messages']} ({s['replayed']} replayed)   seqs: {runs or '-'}\n")
        gaps = ", ".join(f"{a}..{b - 1}" for a, b in s["gaps"][:8]) or "none"
        w(f"  gaps: {gaps}   restarts: {s['restarts']}   resets: {s['resets'] or 'none'}   "
          f"stale: {len(s['stale'])}   live: {s['live']}\n")
        span = ((s["last_ns"] - s["first_ns"]) / 1e9) if s["first_ns"] is not None else 0.0
        w(f"  time span: {span:.3f} s\n")
        for k, n in s["events"].items():
            w(f"  {k:<24} {n}\n")
        w(f"  blocks stored: {s['blocks_stored']}   removed: {s['blocks_removed']}   clears: {s['clears']}   "
          f"cached at end: {s['cached_at_end']}   peak cached: {s['peak_cached']}\n")
        if s["decode_errors"]:
            w(f"  undecodable payloads: {s['decode_errors']}\n")
    for dm in d.get("damage", []):
        w(f"\nDAMAGE {dm['segment']} at byte {dm['offset']}: {dm['reason']} ({dm['lost_bytes']} bytes unread)\n")
