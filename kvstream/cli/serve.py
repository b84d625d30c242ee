"""``kvstream serve``: the router as an HTTP service a load balancer can ask.

::

    kvstream serve e0=tcp://h0:5557,tcp://h0:5558,http=http://h0:8000 e1=tcp://h1:5557 --port 8080
    kvstream serve --config serve.toml          # same names as the flags; SIGHUP reloads engines

Prints ``kvstream serve: listening on http://HOST:PORT`` on stdout once it accepts
requests. SIGINT/SIGTERM stop it cleanly (exit 0); SIGHUP re-reads ``--config`` and follows
the new engine list (engines that stay keep their index). See docs/serve.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import signal
import socket
import sys
from typing import Any, Iterator

from kvstream.cli._common import add_deprecated_alias, positive_int
from kvstream.service.config import ENGINE_SYNTAX, FILE_KEYS

__all__ = ["register", "run"]

log = logging.getLogger("kvstream.service")


def register(sub: Any) -> None:
    """Add the ``serve`` sub-command."""
    p = sub.add_parser(
        "serve", help="serve the router over HTTP (/v1/route, Mooncake indexer API, /metrics)",
        description="Follow engines' KV event streams and answer routing queries over HTTP. "
                    "Flags and the --config file use the same names.",
    )
    p.add_argument("engines", nargs="*", metavar="ENGINE", help=f"an engine to follow: {ENGINE_SYNTAX}")
    p.add_argument("--config", metavar="FILE", help="TOML file with the same names as the flags "
                   f"({', '.join(FILE_KEYS)}); SIGHUP reloads its engine list")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; 0: any free port)")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines as text or one JSON object each")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="default info")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="local tokenizer.json or model folder (HF tokenizers) for {\"prompt\": ...} requests")
    p.add_argument("--load-interval", type=float, metavar="SECONDS",
                   help="scrape each engine's http=URL/metrics this often (default 2; 0: never)")
    p.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest prompt accepted (default 262144)")
    p.add_argument("--max-body-bytes", type=int, metavar="N", help="largest request body (default 8 MiB)")
    p.add_argument("--router-block-size", type=int, metavar="TOKENS", help="router block of /v1/route (default 16)")
    p.add_argument("--index-table", choices=("dict", "compact"),
                   help="block table of the token-keyed indexes: dict (default, fastest ingest, ~150 B per block) "
                        "or compact (~100 B per block)")
    p.add_argument("--index-max-bytes", type=int, metavar="BYTES", help="memory bound of each index")
    p.add_argument("--index-ttl", type=float, metavar="SECONDS", help="drop blocks not stored again for this long")
    p.add_argument("--speculate-ttl", type=float, metavar="SECONDS",
                   help="life of a \"speculate\": true insert (default 2)")
    p.add_argument("--scoring", choices=("prefix", "cost"),
                   help="how engines are ranked: prefix (default: the cached share of the prompt minus a load "
                        "penalty, the --*-weight flags) or cost (the placement model: the least work, uncached "
                        "prompt tokens plus the prefill already sent to the engine, a seeded spread among "
                        "near-equal engines)")
    # The weights' names are kvstream simulate's (Dynamo's --kv-overlap-score-weight); the
    # first spellings of serve stay as deprecated aliases.
    for flag, dest, old, what in (
            ("--kv-overlap-score-weight", "prefix_weight", "--prefix-weight", "weight of the cached prefix (default 1.0)"),
            ("--queue-weight", "queue_weight", None, "penalty per waiting request (default 0.1)"),
            ("--running-weight", "running_weight", None, "penalty per running request (default 0.02)"),
            ("--kv-usage-weight", "kv_weight", "--kv-weight", "penalty per unit of KV cache usage, 0..1 (default 0.2)")):
        a = p.add_argument(flag, dest=dest, type=float, metavar="W", help=f"scoring weight: {what}")
        if old:
            add_deprecated_alias(p, a, old)
    p.add_argument("--register-token-file", metavar="FILE",
                   help="file holding the bearer token /register, /unregister and /v1/dump require (needed "
                        "when --host is not a loopback address)")
    p.add_argument("--insecure-open-admin", action="store_true", default=None,
                   help="serve /register, /unregister and /v1/dump without a token on a non-loopback --host "
                        "(anyone who reaches the port can then add engines and read the whole index)")
    p.add_argument("--max-engines", type=positive_int, metavar="N",
                   help="most engines followed at once, configured and registered (default 256); a /register "
                        "beyond it gets 429")
    p.add_argument("--topic", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--replay-timeout", type=float, metavar="SECONDS", help="replay request timeout (default 2)")
    p.add_argument("--mooncake-seed", type=int, metavar="S", help="seed of the RFC #1527 standard hash (default 0)")
    # Not --workers: Dynamo's indexer calls its engine list --workers (here: ENGINE arguments).
    a = p.add_argument("--processes", dest="workers", type=_process_count, default=1, metavar="N",
                       help="server processes sharing the port (SO_REUSEPORT); each follows every engine and "
                            "keeps its own index (default 1); a /register or /unregister reaching one process "
                            "is passed on to the others")
    add_deprecated_alias(p, a, "--workers")
    p.add_argument("--peers", nargs="+", action="extend", metavar="URL",
                   help="running replicas (http://host:port): load the index from the first that answers "
                        "GET /v1/dump, then follow the engines from there (put it after the engines)")
    p.add_argument("--request-timeout", type=float, metavar="SECONDS",
                   help="answer 408 and close a connection holding a partial request (head or body) this long "
                        "(default 60)")
    p.add_argument("--max-dump-bytes", type=int, metavar="BYTES",
                   help="largest peer dump read (default 1 GiB); a peer sending more is skipped")
    p.add_argument("--peer-timeout", type=float, metavar="SECONDS",
                   help="time for one peer's whole dump (default 30); a slower peer is skipped")
    p.add_argument("--model-name", help="model the configured engines serve, for the Mooncake /query API "
                   "(default: default)")
    g = p.add_argument_group("proxy mode (OpenAI-compatible API in the request path; see docs/proxy.md)")
    g.add_argument("--proxy", action="store_true",
                   help="also serve POST /v1/completions, /v1/chat/completions and GET /v1/models, forwarded "
                        "to the best engine's http=URL (chat templates from --tokenizer's folder)")
    g.add_argument("--proxy-policy", choices=("kv-aware", "round-robin"), default="kv-aware",
                   help="how the proxy picks an engine (default kv-aware)")
    g.add_argument("--speculate", action="store_true",
                   help="the proxy assumes the chosen engine holds the routed prompt for --speculate-ttl "
                        "seconds, until its BlockStored events arrive")
    g.add_argument("--proxy-max-attempts", type=int, default=3, metavar="N",
                   help="engines tried per request on connection failures (default 3)")
    g.add_argument("--proxy-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="first mark-down of an engine that failed (doubles per failure; default 1)")
    g.add_argument("--proxy-max-held-bytes", type=int, default=128 << 20, metavar="BYTES",
                   help="most bytes of non-streamed answers the proxy holds at once, all requests together "
                        "(default 128 MiB); an answer that does not fit is a 503 with Retry-After")
    g.add_argument("--access-log", nargs="?", const="-", metavar="PATH",
                   help="one JSON line per proxied request (time, method, path, status, engine, predicted and "
                        "realized cached tokens, ttfb_s, duration_s, request_id) on stdout, or appended to PATH")
    g = p.add_argument_group("endpoint picker (an Inference Gateway's ext_proc; see docs/gateway.md)")
    g.add_argument("--ext-proc-port", type=int, metavar="PORT",
                   help="also serve Envoy's ext_proc gRPC protocol on --host:PORT (0: any free port), picking "
                        "the engine of each request a gateway forwards (pip install 'kvstream[gateway]')")
    p.set_defaults(func=run)


def _process_count(text: str) -> int:
    """``--processes``: an integer; a Dynamo-style engine list (``0=tcp://...``, what
    Dynamo's indexer takes as ``--workers``) is told where engines go instead."""
    try:
        n = int(text)
    except ValueError:
        pass
    else:
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 process, got {n}")
        return n
    if "=" in text or "://" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} looks like an engine list (Dynamo's --workers); here engines are ENGINE arguments "
            f"({ENGINE_SYNTAX}) and --processes N is a number of server processes")
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of processes")


_FLAGS = ("host", "port", "log_format", "log_level", "tokenizer", "load_interval", "max_prompt_tokens",
          "max_body_bytes", "router_block_size", "index_table", "index_max_bytes", "index_ttl", "speculate_ttl",
          "scoring", "prefix_weight", "queue_weight", "running_weight", "kv_weight", "register_token_file", "topic",
          "replay_timeout", "mooncake_seed", "model_name", "peers", "max_dump_bytes", "peer_timeout",
          "request_timeout", "ext_proc_port", "max_engines", "insecure_open_admin")


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k, None) for k in _FLAGS}


def load_tokenizer(path: str | None) -> Any:
    """A local HF ``tokenizers`` tokenizer from a ``tokenizer.json`` or a folder holding
    one (None: no tokenizer). Raises ``ConfigError``."""
    if path is None:
        return None
    from pathlib import Path

    from kvstream.service.errors import ConfigError

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(f"no tokenizer.json at {path!r}; give a local tokenizer.json or a model folder "
                          "holding one (nothing is downloaded)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
        raise ConfigError(f"cannot load tokenizer {str(p)!r}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Run the service until SIGINT/SIGTERM; 2 for a bad flag or config."""
    from kvstream.service.config import build_config
    from kvstream.service.errors import ConfigError
    from kvstream.service.logs import setup_logging

    try:
        cfg = build_config(_flags(args), list(args.engines), args.config)
        tok = load_tokenizer(cfg.tokenizer)
        _check_file_limit(cfg.max_engines)
    except ConfigError as exc:
        print(f"kvstream serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_format, cfg.log_level)
    proxy_opts = _proxy_options(args, cfg)
    if isinstance(proxy_opts, str):
        print(f"kvstream serve: {proxy_opts}", file=sys.stderr)
        return 2
    workers = getattr(args, "workers", 1) or 1
    if workers < 1:
        print(f"kvstream serve: --processes must be at least 1, got {workers}", file=sys.stderr)
        return 2
    gateway_opts = _gateway_options(args, cfg, proxy_opts, workers)
    if isinstance(gateway_opts, str):
        print(f"kvstream serve: {gateway_opts}", file=sys.stderr)
        return 2
    try:
        sock = _bind(cfg.host, cfg.port, listen=workers == 1, reuseport=workers > 1)
    except OSError as exc:
        print(f"kvstream serve: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
        return 2
    if workers > 1:
        return _supervise(cfg, tok, sock, _flags(args), list(args.engines), workers, proxy_opts)
    import anyio

    with contextlib.closing(sock):
        return anyio.run(_serve, cfg, tok, sock, _flags(args), list(args.engines), None, proxy_opts, None,
                         gateway_opts, backend="asyncio", backend_options=_loop_options())


def _gateway_options(args: argparse.Namespace, cfg: Any, proxy_opts: dict[str, Any] | None,
                     workers: int) -> dict[str, Any] | None | str:
    """The endpoint picker's routing settings (None: no --ext-proc-port), or why not."""
    if cfg.ext_proc_port is None:
        return None
    if workers > 1:
        return "--ext-proc-port runs in one process; leave --processes at 1 (run replicas behind the gateway instead)"
    try:
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError:
        return "--ext-proc-port needs grpcio, grpcio-health-checking and xds-protos: pip install 'kvstream[gateway]'"
    if proxy_opts is not None:
        return proxy_opts  # the same routing (and in-flight counts) as proxy mode
    if args.proxy_max_attempts < 1 or not 0 < args.proxy_backoff <= 15:
        return "--proxy-max-attempts must be >= 1 and --proxy-backoff in (0, 15] seconds"
    from kvstream.proxy.tokenize import TokenizerError
    from kvstream.proxy.tokenize import load_tokenizer as load_chat_tokenizer

    try:
        tok = load_chat_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    except TokenizerError as exc:
        return str(exc)
    return {"tokenizer": tok, "policy": args.proxy_policy, "speculate": args.speculate,
            "max_attempts": args.proxy_max_attempts, "backoff_s": args.proxy_backoff}


def _proxy_options(args: argparse.Namespace, cfg: Any) -> dict[str, Any] | None | str:
    """The proxy mode's settings (None: off), or why they are wrong (a message)."""
    if not getattr(args, "proxy", False):
        if getattr(args, "access_log", None) is not None:
            return "--access-log logs proxied requests: it needs --proxy"
        return None
    from kvstream.proxy.tokenize import TokenizerError
    from kvstream.proxy.tokenize import load_tokenizer as load_chat_tokenizer

    if args.proxy_max_attempts < 1 or not args.proxy_backoff > 0:
        return "--proxy-max-attempts must be >= 1 and --proxy-backoff > 0"
    if not any(e.http for e in cfg.engines):
        return ("--proxy forwards requests to the engines' HTTP APIs, and no engine has one: give each engine "
                "its base URL, e.g. e0=tcp://h:5557,tcp://h:5558,http=http://h:8000")
    if args.proxy_max_held_bytes < 1:
        return f"--proxy-max-held-bytes must be at least 1, got {args.proxy_max_held_bytes}"
    try:
        tok = load_chat_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    except TokenizerError as exc:
        return str(exc)
    access = None
    if args.access_log is not None:
        from kvstream.service.logs import access_logger

        try:
            access = access_logger(args.access_log)
        except OSError as exc:
            return f"--access-log {args.access_log}: {exc.strerror or exc}"
    return {"tokenizer": tok, "policy": args.proxy_policy, "speculate": args.speculate,
            "max_attempts": args.proxy_max_attempts, "backoff_s": args.proxy_backoff,
            "max_held_bytes": args.proxy_max_held_bytes, "access_log": access}


def _check_file_limit(max_engines: int) -> None:
    """Make sure one process may open the file descriptors ``max_engines`` engines need
    (:data:`~kvstream.service.config.FDS_PER_ENGINE` each, plus 1,024 for HTTP
    connections and files), raising the soft limit up to the hard one if it must. Raises
    ``ConfigError`` naming both numbers when the hard limit is too low."""
    import resource

    from kvstream.service.config import FDS_PER_ENGINE
    from kvstream.service.errors import ConfigError

    need = FDS_PER_ENGINE * max_engines + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"--max-engines {max_engines} needs about {need} open files per process, and this one may "
                          f"open {hard} (ulimit -Hn); lower --max-engines to {max(1, (hard - 1024) // FDS_PER_ENGINE)} "
                          "or raise the limit (LimitNOFILE= in systemd, --ulimit nofile= in docker)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _loop_options() -> dict[str, Any]:
    """uvloop (a dependency, not on Windows) when importable: a faster event loop."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _bind(host: str, port: int, *, listen: bool = True, reuseport: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and a header write followed by a body write would otherwise wait
    # for the client's delayed ACK (40 ms per request).
    s = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        if listen:
            s.listen(2048)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def _supervise(cfg: Any, tok: Any, holder: socket.socket, flags: dict[str, Any], cli_engines: list[str],
               workers: int, proxy_opts: dict[str, Any] | None = None) -> int:
    """Fork ``workers`` processes, each listening on the same port with SO_REUSEPORT (the
    kernel spreads connections over them); forward SIGHUP/SIGINT/SIGTERM to them; exit
    when they all have. ``holder`` reserves the port (bound, never listening)."""
    import os

    from kvstream.service.siblings import SiblingChannels

    host, port = holder.getsockname()[:2]
    ready_r, ready_w = os.pipe()
    channels = SiblingChannels(workers)  # registrations reach every worker through these
    pids = []
    for i in range(workers):
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(ready_r)
            holder.close()
            code = 1
            try:
                sock = _bind(host, port, reuseport=True)
                sib = channels.take(i)
                import anyio

                with contextlib.closing(sock), contextlib.closing(sib):
                    code = anyio.run(_serve, cfg, tok, sock, flags, cli_engines, ready_w, proxy_opts, sib,
                                     backend="asyncio", backend_options=_loop_options())
            except BaseException:  # noqa: BLE001 - reported, then the worker exits
                log.exception("worker %d failed", os.getpid())
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(ready_w)
    channels.close()
    got = b""
    while len(got) < workers:
        chunk = os.read(ready_r, workers)
        if not chunk:
            break
        got += chunk
    os.close(ready_r)
    holder.close()
    shown = f"[{host}]" if ":" in host else host
    if len(got) == workers:
        print(f"kvstream serve: listening on http://{shown}:{port} ({len(cfg.engines)} engines, {workers} workers)",
              flush=True)
    def forward(sig: int, frame: Any) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    worst = 0
    for pid in pids:
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        worst = max(worst, os.waitstatus_to_exitcode(status) if status else 0)
    return 0 if worst == 0 else 1


@contextlib.contextmanager
def _no_signal_capture() -> Iterator[None]:
    yield  # kvstream serve handles SIGINT/SIGTERM itself (uvicorn would re-raise them)


async def _serve(cfg: Any, tok: Any, sock: socket.socket, flags: dict[str, Any], cli_engines: list[str],
                 ready_fd: int | None, proxy_opts: dict[str, Any] | None = None, sibling: Any = None,
                 gateway_opts: dict[str, Any] | None = None) -> int:
    """Serve until told to stop: 0, or 1 if the event stream runtime failed (the service
    then stops rather than answer from an index that no longer follows the engines)."""
    import anyio

    # The signals are taken over first thing: a Ctrl-C at any point of the start-up is then
    # queued and asks uvicorn to stop once it runs, instead of cancelling the start-up
    # mid-way (asyncio's own SIGINT handling), which uvicorn logs as a lifespan error with a
    # traceback.
    with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGINT, signal.SIGTERM) as signals:
        return await _serve_in(signals, cfg, tok, sock, flags, cli_engines, ready_fd, proxy_opts, sibling,
                               gateway_opts)


async def _serve_in(signals: Any, cfg: Any, tok: Any, sock: socket.socket, flags: dict[str, Any],
                    cli_engines: list[str], ready_fd: int | None, proxy_opts: dict[str, Any] | None,
                    sibling: Any, gateway_opts: dict[str, Any] | None) -> int:
    import uvicorn

    from kvstream.service.app import create_app
    from kvstream.service.core import ServiceCore

    core = ServiceCore(cfg, tokenizer=tok)
    proxy: Any = None
    if proxy_opts is not None:  # proxy mode: the OpenAI API on top of the same core
        from kvstream.proxy.app import KVProxy

        proxy = KVProxy.for_service(core, **proxy_opts)
        core.proxy_counts_prefill()
        core.engine_view_extras.append(proxy.engine_view)
        core.metrics_extras.append(proxy.metrics_text)
    extproc: Any = None
    if gateway_opts is not None:  # the gateway's endpoint picker, over the same routing
        from time import monotonic

        from kvstream.gateway.extproc import ExtProcServer
        from kvstream.gateway.picker import EndpointPicker
        from kvstream.proxy.app import KVProxy

        picks = proxy
        if picks is None:
            picks = KVProxy.for_service(core, **gateway_opts)
            core.engine_view_extras.append(picks.engine_view)
            core.metrics_extras.append(picks.metrics_text)
        extproc = ExtProcServer(EndpointPicker(picks, clock=monotonic), cfg.host, cfg.ext_proc_port,
                                ready=lambda: core.readyz()[0] == 200)
        core.metrics_extras.append(extproc.metrics_text)
    from kvstream.service.guard import guarded_protocol

    hot = create_app(core, extra_routes=proxy.openai_routes() if proxy is not None else ())
    app: Any = hot
    # uvicorn's protocol with bounded heads and pipelining and JSON errors (service/guard.py)
    def rejected(status: int, code: str) -> None:
        core.metrics.rejected(None, status, code)

    timeout = core.config.request_timeout
    http: Any = guarded_protocol(on_reject=rejected, request_timeout=timeout)
    # The routing calls answered on the connection itself, and the proxy's requests
    # framed there too (each in one task); the rest by uvicorn (kvstream/service/fastpath.py).
    from kvstream.service.fastpath import fast_protocol

    limits = hot.path_limits()
    forward: dict[bytes, Any] = {}
    if proxy is not None:
        app = proxy.asgi(hot)  # its POST routes in raw ASGI, in front of the service's app
        forward = proxy.forwarded()
        limits.update((p, proxy.max_body_bytes) for p in forward)
    # --processes N: each worker evens out the connections with its siblings
    # (kvstream/service/siblings.py), the kernel's SO_REUSEPORT spread being a hash.
    http = fast_protocol(hot.answer, limits, hot.limit, fallback=http, request_timeout=timeout,
                         on_reject=rejected, balancer=sibling, forward=forward)
    # proxy_headers off: no handler reads the client address, and the middleware costs per call.
    ucfg = uvicorn.Config(app, http=http, log_config=None, access_log=False, lifespan="on", server_header=False,
                          date_header=False, proxy_headers=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(ucfg)
    server.capture_signals = _no_signal_capture  # type: ignore[method-assign]

    def stop_on_failure(why: str) -> None:
        server.should_exit = True

    core.on_failure.append(stop_on_failure)
    async with contextlib.AsyncExitStack() as stack:
        if proxy is not None:
            await stack.enter_async_context(proxy)  # closes its upstream connections at the end
        note = ""
        if extproc is not None:  # the gRPC server lives as long as the HTTP one, in this loop
            try:
                await stack.enter_async_context(extproc)
            except OSError as exc:
                print(f"kvstream serve: {exc}", file=sys.stderr)
                return 2
            note = f", ext_proc on {extproc.address}"
        await _run_server(signals, server, sock, core, flags, cli_engines, ready_fd, sibling, note)
    if core.failure is not None:
        log.critical("stopped: %s", core.failure)
        return 1
    return 0


async def _run_server(signals: Any, server: Any, sock: socket.socket, core: Any, flags: dict[str, Any],
                      cli_engines: list[str], ready_fd: int | None, sibling: Any = None, note: str = "") -> None:
    import anyio

    host, port = sock.getsockname()[:2]
    stop = anyio.Event()  # asked to stop: done once uvicorn has started (a clean shutdown)
    async with anyio.create_task_group() as tg:
        async def serve_then_stop() -> None:
            try:
                await server.serve(sockets=[sock])
            finally:
                tg.cancel_scope.cancel()

        async def announce_then_stop() -> None:
            while not server.started:  # uvicorn sets it once the lifespan ran and it accepts
                await anyio.sleep(0.01)
            if ready_fd is None:
                shown = f"[{host}]" if ":" in host else host
                print(f"kvstream serve: listening on http://{shown}:{port} ({len(core.engines)} engines{note})",
                      flush=True)
            else:  # a worker: tell the supervisor
                import os

                os.write(ready_fd, b"!")
                os.close(ready_fd)
            # A stop asked for during the start-up waits until here: uvicorn then shuts the
            # lifespan down in order, where an earlier stop would leave it to be cancelled.
            await stop.wait()
            server.should_exit = True

        tg.start_soon(serve_then_stop)
        if sibling is not None:  # a worker: share registrations (and connections) with the others
            core.mooncake.share = sibling.send
            tg.start_soon(sibling.run, core.mooncake.apply_shared, functools.partial(_adopt, server))
        tg.start_soon(announce_then_stop)
        async for sig in signals:
            if sig == signal.SIGHUP:
                _reload(core, flags, cli_engines)
            else:
                log.info("stopping on %s", signal.Signals(sig).name)
                if stop.is_set():  # asked twice: now, without waiting for the start-up
                    server.should_exit = server.force_exit = True
                stop.set()


async def _adopt(server: Any, sock: socket.socket) -> None:
    """Serve a connection another worker accepted and passed to this one (it had more)."""
    import asyncio

    import anyio

    while not server.started:  # the lifespan first, as for a connection this worker accepts
        await anyio.sleep(0.01)
    loop = asyncio.get_running_loop()
    cfg = server.config

    def protocol() -> Any:
        proto = cfg.http_protocol_class(config=cfg, server_state=server.server_state,
                                        app_state=server.lifespan.state, _loop=loop)
        proto.adopted = True  # served here, never passed on again
        return proto

    sock.setblocking(False)
    await loop.connect_accepted_socket(protocol, sock)


def _reload(core: Any, flags: dict[str, Any], cli_engines: list[str]) -> None:
    from kvstream.service.config import build_config
    from kvstream.service.errors import ConfigError

    try:
        cfg = build_config(flags, cli_engines, core.config.config_file)
    except ConfigError as exc:
        log.error("reload refused, keeping the running engines: %s", exc)
        return
    try:
        added, removed, kept = core.set_engines(cfg.engines)
    except ValueError as exc:  # ApiError: an endpoint the subscriber cannot connect to
        log.error("reload stopped part way: %s", exc)
        return
    log.info("reloaded %s: %d added, %d removed, %d kept", core.config.config_file, len(added), len(removed),
             len(kept), extra={"added": added, "removed": removed, "kept": kept})
