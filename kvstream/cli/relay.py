"""``kvstream relay ENGINE... --nats nats://HOST:4222``: follow engines over ZMQ (with the
subscriber's replay/restart/stale recovery) and publish every batch into a JetStream
stream, payload bytes unchanged, on ``<prefix>.<source>``.

Each ENGINE is ``[NAME=]PUB[,REPLAY]`` as for ``kvstream subscribe``. Two relays of one
engine (high availability) publish each batch once: JetStream drops the second copy by
its message id (``source:instance:seq``). Prints ``relay ready`` on stderr once the
stream is checked and the engines are followed, then a status line every
``--status-interval`` seconds. SIGINT/SIGTERM: waits up to ``--drain-timeout`` seconds
for outstanding acks, prints the counters and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvstream.cli._common import add_log_level
from kvstream.cli._endpoints import add_curve_client_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("relay", help="relay engines' KV events (ZMQ) into a NATS JetStream stream",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engines", nargs="+", metavar="ENGINE", help="[NAME=]PUB[,REPLAY] of an engine")
    p.add_argument("--nats", required=True, action="append", metavar="URL",
                   help="NATS server, nats://HOST:4222 (repeat for a cluster's seeds)")
    p.add_argument("--stream", default="KV_EVENTS", help="JetStream stream (default KV_EVENTS)")
    p.add_argument("--subject-prefix", default="kv", metavar="PREFIX",
                   help="subjects are PREFIX.<source> (default kv)")
    p.add_argument("--storage", choices=("file", "memory"), default="file", help="stream storage (default file)")
    p.add_argument("--max-age", type=float, default=24 * 3600.0, metavar="SECONDS",
                   help="retention by age, seconds (default 86400; 0: none)")
    p.add_argument("--max-bytes", type=int, default=8 << 30, metavar="BYTES",
                   help="retention by size, bytes (default 8 GiB; -1: none)")
    p.add_argument("--replicas", type=int, default=1, help="stream replicas in a NATS cluster (default 1)")
    p.add_argument("--duplicate-window", type=float, default=120.0, metavar="SECONDS",
                   help="how long JetStream remembers message ids (default 120)")
    p.add_argument("--update-stream", action="store_true",
                   help="apply changed retention/replicas to an existing stream")
    p.add_argument("--max-inflight", type=int, default=8192, metavar="N",
                   help="messages awaiting their ack at once (default 8192)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds to wait for NATS at start-up (default 10)")
    p.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (default: all)")
    p.add_argument("--status-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between status lines on stderr (0: none)")
    p.add_argument("--drain-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="seconds to wait for outstanding acks at exit")
    add_curve_client_args(p)
    add_log_level(p)
    p.set_defaults(func=_run)


def _fail(msg: str) -> int:
    print(f"kvstream relay: {msg}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    import anyio

    from kvstream.cli._endpoints import check_connect_endpoint, curve_client_from_args, parse_source

    try:
        from kvstream.jetstream import JetStreamConfigError, StreamSettings, parse_nats_url
    except ImportError:  # pragma: no cover - the extra is missing
        return _fail("needs nats-py: pip install 'kvstream[nats]'")
    try:
        specs = [parse_source(e) for e in args.engines]
        for spec in specs:
            if spec.endpoint.startswith("nats://"):
                raise ValueError(f"{spec.endpoint!r}: a relay follows engines over ZMQ (tcp://, ipc://); "
                                 "--nats names where it publishes")
            check_connect_endpoint(spec.endpoint, "engine endpoint")
            if spec.replay_endpoint:
                check_connect_endpoint(spec.replay_endpoint, "replay endpoint")
        for url in args.nats:
            parse_nats_url(url)
        settings = StreamSettings(name=args.stream, subject_prefix=args.subject_prefix, storage=args.storage,
                                  max_age_s=args.max_age, max_bytes=args.max_bytes, replicas=args.replicas,
                                  duplicate_window_s=args.duplicate_window)
        curve = curve_client_from_args(args)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    try:
        return anyio.run(_main, args, specs, settings, curve)
    except (JetStreamConfigError, ValueError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - e.g. a stream mismatch: one clear line
        if type(exc).__module__.startswith(("kvstream", "nats")):
            return _fail(f"{type(exc).__name__}: {exc}")
        raise


async def _main(args: argparse.Namespace, specs: list, settings: Any, curve: Any) -> int:
    import signal

    import anyio

    from kvstream.jetstream import Relay

    err = sys.stderr
    relay = Relay(specs, args.nats, settings, max_inflight=args.max_inflight, update_stream=args.update_stream,
                  connect_timeout_s=args.connect_timeout,
                  topic=args.topic, curve=curve)
    async with relay:
        err.write(f"relay ready: {len(specs)} engine(s) -> {args.nats[0]}/{settings.name} "
                  f"on {settings.subject_prefix}.<source>\n")
        err.flush()
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

            async def status() -> None:
                while args.status_interval > 0:
                    await anyio.sleep(args.status_interval)
                    err.write(f"[relay] {relay.stats.line()}\n")
                    for h in relay.subscriber.health().values():
                        err.write(f"[health] {h.line()}\n")
                    err.flush()

            async def pump() -> None:
                await relay.run()
                tg.cancel_scope.cancel()

            tg.start_soon(on_signal)
            tg.start_soon(status)
            tg.start_soon(pump)
        try:
            await relay.wait_acked(args.drain_timeout)
        except TimeoutError:
            err.write(f"kvstream relay: {relay.stats.inflight} message(s) still unacknowledged at exit\n")
        err.write(f"[relay] {relay.stats.line()}\n")
    return 0
