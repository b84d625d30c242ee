"""``python -m kvstream.proxy``: run the KV-aware OpenAI-compatible proxy on its own.

    python -m kvstream.proxy --engine e0=http://127.0.0.1:8000,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 \\
        --engine e1=http://127.0.0.1:8001,tcp://127.0.0.1:5567,tcp://127.0.0.1:5568 --port 9000

Each ``--engine`` is ``NAME=HTTP_URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]``. Once it accepts
connections it prints ``kvstream proxy: ready http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kvstream.proxy.core import Upstream

__all__ = ["main", "parse_upstream"]


def parse_upstream(text: str) -> Upstream:
    """An :class:`~kvstream.proxy.core.Upstream` from ``NAME=URL[,EVENTS[,REPLAY]]``."""
    name, sep, rest = text.partition("=")
    parts = [p.strip() for p in rest.split(",")] if sep else []
    if not name or not parts or not parts[0].startswith(("http://", "https://")):
        raise ValueError(f"--engine {text!r}: write NAME=http://HOST:PORT[,tcp://HOST:EVENTS[,tcp://HOST:REPLAY]]")
    return Upstream(name, parts[0].rstrip("/"), parts[1] if len(parts) > 1 else None,
                    parts[2] if len(parts) > 2 else None)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, serve until SIGINT/SIGTERM; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m kvstream.proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", required=True, metavar="NAME=URL[,EVENTS[,REPLAY]]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000, help="HTTP port (0: any free port)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or model folder (text prompts, chat)")
    p.add_argument("--chat-template", metavar="JINJA_OR_FILE")
    p.add_argument("--block-size", type=int, default=16, help="the engines' KV block size (tokens)")
    p.add_argument("--policy", choices=("kv-aware", "round-robin"), default="kv-aware")
    p.add_argument("--speculate", type=float, metavar="SECONDS", nargs="?", const=2.0, default=None,
                   help="assume the chosen engine holds the routed prompt until its events arrive (default 2 s)")
    p.add_argument("--max-attempts", type=int, default=3, help="engines tried per request (default 3)")
    p.add_argument("--backoff", type=float, default=1.0, help="first mark-down of a failed engine, seconds")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = p.parse_args(argv)
    import anyio

    from kvstream.proxy.app import KVProxy, serve_proxy
    from kvstream.proxy.tokenize import TokenizerError, load_tokenizer

    try:
        ups = [parse_upstream(e) for e in args.engine]
        tok = load_tokenizer(args.tokenizer, chat_template=args.chat_template) if args.tokenizer else None
        proxy = KVProxy(ups, tokenizer=tok, block_size=args.block_size, policy=args.policy,
                        speculate_s=args.speculate, max_attempts=args.max_attempts, backoff_s=args.backoff)
    except (ValueError, TokenizerError) as exc:
        print(f"kvstream proxy: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(lambda: serve_proxy(proxy, args.host, args.port,
                                      lambda url: print(f"kvstream proxy: ready {url}", flush=True),
                                      log_level=args.log_level),
                  backend_options=_loop_options())
    except OSError as exc:
        print(f"kvstream proxy: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _loop_options() -> dict[str, bool]:
    """uvloop when it is installed (``pip install kvstream[fast]``): less latency per hop."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


if __name__ == "__main__":
    sys.exit(main())
