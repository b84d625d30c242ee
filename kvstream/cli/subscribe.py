"""``kvstream subscribe ENDPOINT...``: follow KV event publishers and print their events live.

Each ENDPOINT is ``tcp://host:port`` (or ``ipc:///path``) with optional comma-separated options:
``tcp://h:5557,replay=tcp://h:5558,name=engine-0``. One line per event on stdout
(human-readable, or JSON lines with ``--json``), stream notices (reset, stale, live) as
lines too, and a health line per source on stderr every ``--health-interval`` seconds and
at exit. Ctrl-C (SIGINT) or SIGTERM exits cleanly with status 0; so does a closed stdout
(``| head``).

Topics: every message carries a topic frame, and ``--topic`` keeps those that start with
the given prefix. The default (empty) keeps all. vLLM's topic is its
``kv_events_config.topic``, empty unless set, so ``--topic kv@`` receives nothing from a
default vLLM; use it only when the publishers set such a topic.

Block hashes are hex (16 digits for 64-bit hashes, every byte for byte hashes), as in
``kvstream inspect``; ``--hash-format int`` shows unsigned integers instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any, TextIO


from kvstream.cli._common import (
    add_hash_format,
    add_log_level,
    exception_leaves,
    format_hash,
    non_negative_float,
    non_negative_int,
    quiet_stdout,
)
from kvstream.cli._endpoints import add_curve_client_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "subscribe",
        help="follow KV event publishers (vLLM or kvstream) and print decoded events live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("endpoints", nargs="+", metavar="ENDPOINT",
                   help="PUB endpoint, optionally with ,replay=ENDPOINT and ,name=NAME")
    p.add_argument("--replay", action="append", default=[], metavar="ENDPOINT",
                   help="replay endpoint for the ENDPOINT in the same position (alternative to ,replay=)")
    p.add_argument("--name", action="append", default=[], metavar="NAME",
                   help="source name for the ENDPOINT in the same position (alternative to ,name=)")
    p.add_argument("--topic", default="", metavar="PREFIX",
                   help="keep messages whose topic starts with PREFIX (default: all; vLLM's default topic is "
                        "empty, see Topics above)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of text")
    add_hash_format(p)
    p.add_argument("--health-interval", type=non_negative_float, default=5.0, metavar="SECONDS",
                   help="seconds between health lines on stderr (0: only at exit)")
    p.add_argument("--count", type=non_negative_int, default=0, metavar="N",
                   help="exit after N batches (0: run until interrupted)")
    p.add_argument("--replay-timeout", type=non_negative_float, default=2.0, metavar="SECONDS",
                   help="seconds of silence before a replay request is retried")
    add_curve_client_args(p)
    add_log_level(p)
    p.set_defaults(func=_run)


def jsonable(o: Any, hashes: str = "hex") -> Any:
    """``o`` (decoded msgpack: any value an event's free-form fields may hold) as plain
    JSON data: bytes as hex, msgpack extension values as ``{"ext": code, "data": hex}``,
    map keys that are not strings (ints, arrays, bytes) as their JSON text."""
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if isinstance(o, (bytes, bytearray, memoryview)):
        return bytes(o).hex()
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            key = k if isinstance(k, str) else json.dumps(jsonable(k, hashes), separators=(",", ":"))
            out[key] = jsonable(v, hashes)
        return out
    if isinstance(o, (list, tuple)):
        return [jsonable(x, hashes) for x in o]
    import msgspec

    if isinstance(o, msgspec.msgpack.Ext):
        return {"ext": o.code, "data": bytes(o.data).hex()}
    if isinstance(o, msgspec.Struct):
        return jsonable(msgspec.structs.asdict(o), hashes)
    return str(o)


def _event_json(ev: Any, hashes: str) -> dict[str, Any]:
    import msgspec

    d = jsonable(msgspec.to_builtins(ev, builtin_types=(bytes, bytearray, msgspec.msgpack.Ext)), hashes)
    for key in ("block_hashes",):
        if key in d:
            d[key] = [format_hash(h, hashes) for h in ev.block_hashes]
    if getattr(ev, "parent_block_hash", None) is not None:
        d["parent_block_hash"] = format_hash(ev.parent_block_hash, hashes)
    return d


def _short(h: Any, hashes: str = "hex") -> str:
    return str(format_hash(h, hashes, short=True))


def _event_text(ev: Any, hashes: str = "hex") -> str:
    from kvstream.wire.events import BlockRemoved, BlockStored

    if isinstance(ev, BlockStored):
        parent = _short(ev.parent_block_hash, hashes) if ev.parent_block_hash is not None else "-"
        extra = f" lora={ev.lora_name or ev.lora_id}" if (ev.lora_name or ev.lora_id) is not None else ""
        grp = f" g{ev.group_idx}" if ev.group_idx is not None else ""
        return (f"BlockStored {ev.medium}{grp} blocks={len(ev.block_hashes)} "
                f"[{' '.join(_short(h, hashes) for h in ev.block_hashes)}] parent={parent} "
                f"tokens={len(ev.token_ids)}{extra}")
    if isinstance(ev, BlockRemoved):
        grp = f" g{ev.group_idx}" if ev.group_idx is not None else ""
        return f"BlockRemoved {ev.medium}{grp} [{' '.join(_short(h, hashes) for h in ev.block_hashes)}]"
    return type(ev).__name__


def health_line(h: Any) -> str:
    """One source's health (a :class:`~kvstream.transport.SourceHealth`) as one line.
    ``replays`` counts the replay requests made to recover lost batches; the idle probes
    (a replay request sent to a quiet source to check that nothing was missed, every
    ``probe_after_s`` up to ``probe_max_s``) are counted apart as ``probes``."""
    c = h.counters
    probes = int(c.get("probes", 0))
    return (f"{h.source}: {h.state} seq={h.last_seq} batches={c['batches']} "
            f"events={c['events']} gaps={c['gaps']} replays={max(0, c['replays'] - probes)} probes={probes} "
            f"snapshots={c['snapshots']} restarts={c['restarts']} stale={c['stale_marks']} "
            f"dups={c['duplicates']} decode_errors={c['decode_errors']} "
            f"frame_errors={c['frame_errors']} lag={c['lag_s'] * 1000:.1f}ms")


def print_item(item: Any, as_json: bool, out: TextIO, hashes: str = "hex") -> None:
    """Write one subscriber item (one line per event for batches); ``hashes``: "hex" or
    "int" (see :func:`kvstream.cli._common.format_hash`)."""
    from kvstream.transport import SourceBatch, SourceLive, SourceReset, SourceStale

    if isinstance(item, SourceBatch):
        b = item.batch
        for ev in b.events:
            if as_json:
                row = {"source": item.source, "seq": item.seq, "rank": b.data_parallel_rank, "ts": b.ts,
                       "replayed": item.replayed, "event": _event_json(ev, hashes)}
                out.write(json.dumps(row) + "\n")
            else:
                flag = " (replay)" if item.replayed else ""
                out.write(f"{item.source} #{item.seq} r{b.data_parallel_rank} {_event_text(ev, hashes)}{flag}\n")
        return
    if isinstance(item, SourceReset):
        rec = {"source": item.source, "notice": "reset", "reason": item.reason, "seq": item.seq}
    elif isinstance(item, SourceStale):
        rec = {"source": item.source, "notice": "stale", "reason": item.reason,
               "first_missing_seq": item.first_missing_seq, "resume_seq": item.resume_seq}
    elif isinstance(item, SourceLive):
        rec = {"source": item.source, "notice": "live", "seq": item.seq}
    else:  # pragma: no cover - the subscriber yields nothing else
        return
    if as_json:
        out.write(json.dumps(rec) + "\n")
    else:
        rest = " ".join(f"{k}={v}" for k, v in rec.items() if k not in ("source", "notice"))
        out.write(f"# {item.source} {str(rec['notice']).upper()} {rest}\n")


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.cli._endpoints import check_connect_endpoint, curve_client_from_args, parse_source
    from kvstream.errors import KVStreamError

    for flag, given in (("--replay", args.replay), ("--name", args.name)):
        if len(given) > len(args.endpoints):
            print(f"kvstream subscribe: {len(given)} {flag} flags for {len(args.endpoints)} endpoint(s); each "
                  f"{flag} pairs with the ENDPOINT in the same position", file=sys.stderr)
            return 2
    specs = []
    for i, ep in enumerate(args.endpoints):
        replay = args.replay[i] if i < len(args.replay) else None
        name = args.name[i] if i < len(args.name) else None
        try:
            spec = parse_source(ep, replay, name)
            check_connect_endpoint(spec.endpoint, "endpoint")
            if spec.replay_endpoint:
                check_connect_endpoint(spec.replay_endpoint, "replay endpoint")
            specs.append(spec)
        except ValueError as exc:
            print(f"kvstream subscribe: {exc}", file=sys.stderr)
            return 2
    try:
        curve = curve_client_from_args(args)
    except (ValueError, OSError, KVStreamError) as exc:
        print(f"kvstream subscribe: {exc}", file=sys.stderr)
        return 2
    from kvstream.errors import LocalProtocolError

    try:
        return anyio.run(_main, args, specs, curve)
    except LocalProtocolError as exc:  # e.g. no NATS server at a nats:// URL
        print(f"kvstream subscribe: {exc}", file=sys.stderr)
        return 2


async def _main(args: argparse.Namespace, specs: list, curve: Any) -> int:
    import anyio

    from kvstream.transport import Subscriber

    out, err = sys.stdout, sys.stderr

    def health(sub: Subscriber) -> None:
        for h in sub.health().values():
            err.write(f"[health] {health_line(h)}\n")
        err.flush()

    try:
        from kvstream.jetstream import open_subscriber  # ZMQ, or JetStream for nats:// URLs

        sub_cm = open_subscriber(specs, topic=args.topic, curve=curve, replay_timeout_s=args.replay_timeout)
    except ValueError as exc:
        err.write(f"kvstream subscribe: {exc}\n")
        return 2
    closed = False
    async with sub_cm as sub:
        try:
            async with anyio.create_task_group() as tg:
                await _follow(args, sub, tg, out, health)
            out.flush()
        except BrokenPipeError:
            closed = True  # stdout's reader left (`| head`): what arrived was printed
        except BaseException as exc:
            if not all(isinstance(e, BrokenPipeError) for e in exception_leaves(exc)):
                raise
            closed = True
        health(sub)
    if closed:
        quiet_stdout()
    return 0


async def _follow(args: argparse.Namespace, sub: Any, tg: Any, out: TextIO, health: Any) -> None:
    import anyio

    from kvstream.transport import SourceBatch

    async def on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                tg.cancel_scope.cancel()
                return

    async def health_loop() -> None:
        while args.health_interval > 0:
            await anyio.sleep(args.health_interval)
            health(sub)

    async def consume() -> None:
        n = 0
        async for item in sub:
            print_item(item, args.json, out, args.hash_format)
            if isinstance(item, SourceBatch):
                n += 1
                if args.count and n >= args.count:
                    break
            if not sub.ready:  # flush when idle, not per line
                out.flush()
        out.flush()
        tg.cancel_scope.cancel()

    tg.start_soon(on_signal)
    tg.start_soon(health_loop)
    tg.start_soon(consume)
