"""``kvstream replay LOG --publish ENDPOINT``: re-publish a recording onto real sockets."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstream.cli._common import CLIError, add_log_level, non_negative_float, non_negative_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-publish an event log (original topics, seqs and payloads) at 1x, 10x or max speed",
        description=(
            "Re-publish the messages of an event log with a real publisher (PUB + replay "
            "ROUTER), so any vLLM-compatible consumer can be tested against a recording. Each "
            "--publish PUB[,REPLAY] serves one source, in the order the sources first appear "
            "in the log (or as listed with --source). Also accepts a KVSTRM01 capture. "
            "Every --publish endpoint is bound (replay serves sockets; subscribers connect), "
            "e.g. tcp://127.0.0.1:5557, tcp://*:5557 or ipc:///tmp/e0.sock."
        ),
    )
    p.add_argument("log", help="event log file or directory, or a KVSTRM01 capture")
    p.add_argument("--publish", action="append", required=True, metavar="PUB[,REPLAY]",
                   help="endpoint(s) to bind for one source (repeat once per source)")
    p.add_argument("--source", action="append", metavar="NAME", help="the source(s) to replay, in --publish order")
    p.add_argument("--speed", default="1x", help="1x (recorded timing), 10x, 0.5x ..., or max (default 1x)")
    p.add_argument("--wait-s", type=non_negative_float, default=0.5,
                   help="seconds to wait after binding before publishing (subscribers connect)")
    p.add_argument("--wait-subscribers", type=non_negative_int, default=0, metavar="N",
                   help="before publishing (and before --wait-s), wait until N subscribers have "
                        "subscribed to every --publish endpoint (default 0: do not wait)")
    p.add_argument("--hold-s", type=non_negative_float, default=1.0,
                   help="seconds to keep the sockets open after the last message (late replay requests)")
    add_log_level(p)
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
    if not (0 < v < float("inf")):  # also refuses nan
        raise ValueError(f"--speed {text!r} must be a positive finite factor (or max for no pacing)")
    return v


def _run(args: argparse.Namespace) -> int:
    import anyio
    import zmq

    from kvstream.cli._endpoints import check_bind_endpoint, check_distinct_bind_endpoints, parse_source
    from kvstream.eventlog.format import LogFormatError, LogMessage

    try:
        # What the command line says is checked first (exit status 2), the log after (1).
        speed = parse_speed(args.speed)
        specs = [parse_source(ep) for ep in args.publish]
        for spec in specs:
            check_bind_endpoint(spec.endpoint, "--publish")
            if spec.replay_endpoint:
                check_bind_endpoint(spec.replay_endpoint, "--publish (replay endpoint)")
        check_distinct_bind_endpoints(specs, "--publish")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        from kvstream.cli.inspect import _records

        records_iter, reader = _records(args.log)
        records = list(records_iter)
        first: dict[str, LogMessage] = {}
        for r in records:
            if type(r) is LogMessage and r.source not in first:
                first[r.source] = r
        sources = args.source or list(first)
        if not first:
            damage = reader.damage if reader is not None else []
            print(f"kvstream replay: {args.log} holds no messages to replay"
                  + (f" (DAMAGED: {damage[0]})" if damage else ""), file=sys.stderr)
            return 3 if damage else 1
        missing = [s for s in sources if s not in first]
        if missing:
            raise CLIError(f"no messages from source(s) {missing} in the log; sources: {list(first)}")
        if len(sources) != len(args.publish):
            raise CLIError(
                f"the log has {len(sources)} source(s) to replay ({', '.join(sources)}) but "
                f"{len(args.publish)} --publish endpoint(s) were given; give one --publish per source, "
                f"or pick sources with --source (e.g. --source {sources[0]})"
            )
        total = sum(1 for r in records if type(r) is LogMessage and r.source in sources)
        stats, interrupted = anyio.run(_replay, args, specs, records, sources, first, speed)
    except zmq.ZMQError as exc:
        print(f"kvstream replay: cannot bind {exc.strerror if hasattr(exc, 'strerror') else exc}: "
              f"{_bind_hint(exc)}", file=sys.stderr)
        return 1
    except (LogFormatError, FileNotFoundError, ValueError, OSError) as exc:
        print(f"kvstream replay: {exc}", file=sys.stderr)
        return 1
    d = stats.as_dict()
    if interrupted:
        print(f"kvstream replay: interrupted after sending {d['sent']} of {total} messages "
              f"in {d['elapsed_s']:.3f} s; the log was only read, nothing was written", file=sys.stderr)
        return 130
    msg = f"replayed {d['sent']} batches in {d['elapsed_s']:.3f} s"
    if speed is not None:
        msg += f"; lateness p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us, max {d['max_us']:.0f} us"
    print(msg, file=sys.stderr)
    if reader is not None and reader.damage:
        for dm in reader.damage:
            print(f"kvstream replay: DAMAGED (replayed the intact part): {dm}", file=sys.stderr)
        return 3
    return 0


def _bind_hint(exc: Exception) -> str:
    import errno

    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return "another process already serves that address; pick a free port (or port 0 for any)"
    if getattr(exc, "errno", None) == errno.EADDRNOTAVAIL:
        return "that address is not one of this machine's; use 127.0.0.1, * (all interfaces) or a local IP"
    return "check the --publish endpoint"


async def _replay(args, specs, records, sources, first, speed):
    import signal
    from contextlib import AsyncExitStack

    import anyio
    import zmq

    from kvstream.eventlog.replay import Pacer, replay_to_publishers
    from kvstream.transport import KVEventsConfig, Publisher

    pacer = Pacer(speed)
    interrupted = False
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def on_signal(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                task_status.started()
                async for _ in signals:
                    interrupted = True
                    tg.cancel_scope.cancel()
                    return

        # Ctrl-C is ours from before the first socket is bound.
        await tg.start(on_signal)
        try:
            async with AsyncExitStack() as stack:
                pubs = {}
                for src, spec in zip(sources, specs):
                    m = first[src]
                    cfg = KVEventsConfig(publisher="zmq", endpoint=spec.endpoint,
                                         replay_endpoint=spec.replay_endpoint,
                                         topic=m.topic.decode("utf-8", "replace"))
                    try:
                        pubs[src] = await stack.enter_async_context(Publisher(cfg, bind=True))
                    except zmq.ZMQError as exc:
                        raise zmq.ZMQError(exc.errno, f"{spec.endpoint}"
                                           + (f" or {spec.replay_endpoint}" if spec.replay_endpoint else "")
                                           + f" ({exc.strerror})") from None
                    print(f"{src} -> {pubs[src].endpoint}" + (f" (replay {pubs[src].replay_endpoint})"
                                                              if spec.replay_endpoint else ""),
                          file=sys.stderr, flush=True)
                if args.wait_subscribers:
                    print(f"waiting for {args.wait_subscribers} subscriber(s) on each endpoint",
                          file=sys.stderr, flush=True)
                    for p in pubs.values():
                        await p.wait_subscribed(args.wait_subscribers)
                await anyio.sleep(args.wait_s)
                await replay_to_publishers(records, pubs, speed=speed, pacer=pacer)
                if args.hold_s > 0:
                    print(f"sent {pacer.stats.sent} batches; answering replay requests for {args.hold_s:g} s more",
                          file=sys.stderr, flush=True)
                await anyio.sleep(args.hold_s)
        except (zmq.ZMQError, ValueError) as exc:  # ValueError: EndpointError from the publisher
            error = exc  # raised below, outside the task group (which would wrap it)
        finally:
            tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return pacer.stats, interrupted
