"""``kvstream replay LOG --publish ENDPOINT``: re-publish a recording onto real sockets."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-publish an event log (original topics, seqs and payloads) at 1x, 10x or max speed",
        description=(
            "Re-publish the messages of an event log with a real publisher (PUB + replay "
            "ROUTER), so any vLLM-compatible consumer can be tested against a recording. Each "
            "--publish PUB[,REPLAY] serves one source, in the order the sources first appear "
            "in the log (or as listed with --source). Also accepts a KVSTRM01 capture."
        ),
    )
    p.add_argument("log", help="event log file or directory, or a KVSTRM01 capture")
    p.add_argument("--publish", action="append", required=True, metavar="PUB[,REPLAY]",
                   help="endpoint(s) to bind for one source (repeat once per source)")
    p.add_argument("--source", action="append", metavar="NAME", help="the source(s) to replay, in --publish order")
    p.add_argument("--speed", default="1x", help="1x (recorded timing), 10x, 0.5x ..., or max (default 1x)")
    p.add_argument("--wait-s", type=float, default=0.5,
                   help="seconds to wait after binding before publishing (subscribers connect)")
    p.add_argument("--hold-s", type=float, default=1.0,
                   help="seconds to keep the sockets open after the last message (late replay requests)")
    p.set_defaults(func=_run)


def parse_speed(text: str) -> float | None:
    """``"max"`` -> None, ``"10x"``/``"10"`` -> 10.0."""
    t = text.strip().lower()
    if t == "max":
        return None
    try:
        v = float(t[:-1] if t.endswith("x") else t)
    except ValueError:
        raise ValueError(f"--speed {text!r}: expected e.g. 1x, 10x, 0.5x or max") from None
    if v <= 0:
        raise ValueError(f"--speed {text!r} must be positive")
    return v


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.eventlog.format import LogFormatError, LogMessage

    try:
        speed = parse_speed(args.speed)
        from kvstream.cli.inspect import _records

        records_iter, reader = _records(args.log)
        records = list(records_iter)
        first: dict[str, LogMessage] = {}
        for r in records:
            if type(r) is LogMessage and r.source not in first:
                first[r.source] = r
        sources = args.source or list(first)
        missing = [s for s in sources if s not in first]
        if missing:
            raise ValueError(f"no messages from source(s) {missing} in the log; sources: {list(first)}")
        if len(sources) != len(args.publish):
            raise ValueError(
                f"the log has {len(sources)} source(s) to replay ({', '.join(sources)}) but "
                f"{len(args.publish)} --publish endpoint(s) were given; give one per source or pick "
                "sources with --source"
            )
        stats = anyio.run(_replay, args, records, sources, first, speed)
    except (LogFormatError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"kvstream replay: {exc}", file=sys.stderr)
        return 1
    d = stats.as_dict()
    msg = f"replayed {d['sent']} batches in {d['elapsed_s']:.3f} s"
    if speed is not None:
        msg += f"; lateness p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us, max {d['max_us']:.0f} us"
    print(msg, file=sys.stderr)
    if reader is not None and reader.damage:
        for dm in reader.damage:
            print(f"kvstream replay: DAMAGED (replayed the intact part): {dm}", file=sys.stderr)
        return 3
    return 0


async def _replay(args, records, sources, first, speed):
    from contextlib import AsyncExitStack

    import anyio

    from kvstream.cli._endpoints import parse_source
    from kvstream.eventlog.replay import replay_to_publishers
    from kvstream.transport import KVEventsConfig, Publisher

    async with AsyncExitStack() as stack:
        pubs = {}
        for src, ep in zip(sources, args.publish):
            spec = parse_source(ep)
            pub_ep, rep_ep = spec.endpoint, spec.replay_endpoint
            m = first[src]
            cfg = KVEventsConfig(publisher="zmq", endpoint=pub_ep, replay_endpoint=rep_ep or None,
                                 topic=m.topic.decode("utf-8", "replace"))
            pubs[src] = await stack.enter_async_context(Publisher(cfg))
            print(f"{src} -> {pubs[src].endpoint}" + (f" (replay {pubs[src].replay_endpoint})"
                                                      if rep_ep else ""), file=sys.stderr)
        await anyio.sleep(args.wait_s)
        stats = await replay_to_publishers(records, pubs, speed=speed)
        await anyio.sleep(args.hold_s)
    return stats
