"""``kvstream engine``: an emulated vLLM engine (OpenAI-compatible HTTP + KV events on ZMQ).

No GPU, no model: the KV cache is kvstream's real allocator (prefix caching, chunked
prefill, preemption), timing follows a simple model (prefill tokens/s, decode tokens/s per
sequence, batch limits; cached prefix tokens cost nothing), output tokens are
deterministic. It answers ``/v1/completions``, ``/v1/chat/completions`` (streaming or
not), ``/v1/models``, ``/health`` and ``/metrics`` (vLLM's metric names) and publishes
its KV events exactly as vLLM does with ``--kv-events-config``.

Size the cache with ``--num-gpu-blocks-override``, or from a model with ``--model-config
config.json --gpu-memory 80GiB`` (kvstream.planning, as ``kvstream plan`` does). Once both
HTTP and the event sockets accept, one line is printed:

    kvstream engine: ready http://127.0.0.1:8000 events tcp://0.0.0.0:5557 (bind) replay tcp://0.0.0.0:5558 (bind) ...

"(bind)": subscribers connect there. An events endpoint without ``*`` is *connected to*
(vLLM's rule), shown "(connect)": only a subscriber that binds that address hears it
(``SourceSpec(..., bind=True)``), and the engine warns once if none did within 5 s.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvstream.cli._common import (
    CLIError,
    add_deprecated_alias,
    check_block_memory,
    fraction,
    port_number,
    positive_float,
    positive_int,
)
from kvstream.cli.plan import parse_memory


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``engine`` sub-command."""
    p = sub.add_parser("engine", help="run an emulated vLLM engine (OpenAI HTTP API + KV events, no GPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h = p.add_argument_group("serving")
    h.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    h.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    h.add_argument("--served-model-name", "--model", dest="model", default="kvstream-emulated",
                   help="model name clients must use (default kvstream-emulated)")
    h.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer.json or a model folder, for text prompts and chat (default: UTF-8 bytes)")
    h.add_argument("--chat-template", metavar="JINJA_OR_FILE", help="override the tokenizer's chat template")
    h.add_argument("--kv-events-config", metavar="JSON",
                   help="vLLM's KV events config, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'")
    h.add_argument("--wire-version", choices=("0.11", "0.26"), default="0.26",
                   help="vLLM wire format of the events: 0.26+ maps (default) or 0.11 arrays")
    h.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="server log level (default warning)")
    h.add_argument("--timeout-keep-alive", type=positive_int, default=5, metavar="SECONDS",
                   help="close a kept-alive connection idle this long (default 5, as vLLM's server)")
    c = p.add_argument_group("KV cache")
    a = c.add_argument("--num-gpu-blocks-override", dest="num_gpu_blocks", type=positive_int, metavar="N",
                       help="KV blocks (vLLM's name; default 4096, or planned from --model-config, which this "
                            "overrides as in vLLM)")
    add_deprecated_alias(c, a, "--num-gpu-blocks")
    c.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    c.add_argument("--max-model-len", type=positive_int, metavar="TOKENS",
                   help="longest prompt+output (default: the model config's, else 16384)")
    c.add_argument("--model-config", metavar="CONFIG_JSON", help="plan the cache for this Hugging Face config.json")
    c.add_argument("--gpu-memory", type=parse_memory, metavar="SIZE", help="GPU memory for --model-config, e.g. 80GiB")
    c.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, help="share of --gpu-memory used (0.9)")
    c.add_argument("--model-weights-gib", type=parse_memory, metavar="SIZE", default=0,
                   help="checkpoint size subtracted from the budget (default 0)")
    c.add_argument("--prefix-caching-hash-algo", default="sha256",
                   help="block hash algorithm: sha256 (vLLM's default), sha256_cbor, xxhash, xxhash_cbor, native")
    t = p.add_argument_group("timing")
    t.add_argument("--prefill-tokens-per-s", type=positive_float, default=20000.0,
                   help="prompt tokens computed per second (default 20000)")
    t.add_argument("--decode-tokens-per-s", type=positive_float, default=50.0,
                   help="output tokens per second per sequence (default 50)")
    t.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                   help="tokens computed per step (default 8192)")
    t.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests running at once (default 64)")
    t.add_argument("--default-max-tokens", type=positive_int, default=16,
                   help="output tokens when a request sets no max_tokens (default 16)")
    t.add_argument("--seed", type=int, default=0, help="output token seed (default 0)")
    p.set_defaults(func=_run)


def build_config(args: argparse.Namespace) -> Any:
    """The :class:`EmulatorConfig` the options describe; ValueError with a clear message."""
    from kvstream.emulator.core import EmulatorConfig
    from kvstream.hashing import ALGORITHMS

    if args.prefix_caching_hash_algo not in ALGORITHMS:
        raise ValueError(f"unknown --prefix-caching-hash-algo {args.prefix_caching_hash_algo!r}; "
                         f"choose from {', '.join(ALGORITHMS)}")
    blocks = args.num_gpu_blocks
    max_len = args.max_model_len
    if not args.model_config and (args.gpu_memory is not None or args.model_weights_gib):
        raise ValueError("--gpu-memory and --model-weights-gib size the cache from a model; they need "
                         "--model-config CONFIG_JSON (without it, give --num-gpu-blocks-override)")
    if args.model_config:
        from kvstream.planning import plan_from_hf_config
        from kvstream.planning.hf_config import model_max_len

        if args.gpu_memory is None:
            raise ValueError("--model-config needs --gpu-memory (e.g. --gpu-memory 80GiB)")
        try:
            cfg = json.loads(open(args.model_config, encoding="utf-8").read())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read --model-config {args.model_config!r}: {exc}") from None
        if max_len is None:
            max_len = model_max_len(cfg) or 16384
        budget = int(args.gpu_memory * args.gpu_memory_utilization) - int(args.model_weights_gib)
        if budget <= 0:
            raise ValueError("no memory is left for the KV cache: raise --gpu-memory or lower --model-weights-gib")
        plan = plan_from_hf_config(cfg, budget, max_len, block_size=args.block_size,
                                   num_gpu_blocks_override=blocks)
        blocks = plan.num_blocks
    return EmulatorConfig(
        model=args.model, num_gpu_blocks=blocks or 4096, block_size=args.block_size,
        max_model_len=max_len or 16384, prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, hash_algo=args.prefix_caching_hash_algo, seed=args.seed,
        default_max_tokens=args.default_max_tokens)


def events_config(text: str | None, wire_version: str) -> Any:
    """The publisher config from vLLM's ``--kv-events-config`` JSON (None: no events)."""
    from kvstream.transport.config import KVEventsConfig

    if not text:
        return None
    try:
        d = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    if d.get("publisher") not in (None, "null", "zmq"):
        # vLLM's EventPublisherFactory refuses it at start-up too ("Unknown event publisher").
        raise ValueError(f"--kv-events-config: unknown publisher {d['publisher']!r}; use \"zmq\" (or \"null\")")
    if wire_version == "0.11":
        d.setdefault("encoding", "array")
        d.setdefault("replay_topic_frame", False)
        d.setdefault("vllm_version", "0.11")  # 0.11's endpoint rules and publisher default
    cfg = KVEventsConfig.from_dict(d)
    if not cfg.enable_kv_cache_events:
        # vLLM's publisher factory gives a null publisher then, whatever "publisher" says.
        if "publisher" in d or "endpoint" in d:
            print('kvstream engine: note: "enable_kv_cache_events" is false in --kv-events-config: no KV events '
                  "are published (as vLLM); set it to true to publish them", file=sys.stderr)
        return None
    if cfg.enable_kv_cache_events and cfg.publisher == "null" and "publisher" not in d:
        # vLLM 0.11 publishes nothing then, silently; say so once.
        print('kvstream engine: note: under vLLM 0.11 rules events are published only with "publisher": "zmq" '
              "in --kv-events-config; none will be sent", file=sys.stderr)
    return cfg


def _run(args: argparse.Namespace) -> int:
    import anyio
    import zmq

    from kvstream.emulator.server import EngineReady, EngineServer
    from kvstream.planning import KVCachePlanningError
    from kvstream.proxy.tokenize import TokenizerError, load_tokenizer

    try:
        config = build_config(args)
        check_block_memory(config.num_gpu_blocks, f"{config.num_gpu_blocks:,} KV blocks",
                           "lower --num-gpu-blocks-override (or --gpu-memory with --model-config)")
        ev = events_config(args.kv_events_config, args.wire_version)
        tok = load_tokenizer(args.tokenizer, chat_template=_chat_template(args.chat_template))
        if args.chat_template is not None:
            # Tried once now (with the tokenizer's special tokens), so a broken template fails
            # here and not on every chat request.
            tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    except (ValueError, KVCachePlanningError, TokenizerError, OSError, CLIError) as exc:
        print(f"kvstream engine: {exc}", file=sys.stderr)
        return 2
    if args.tokenizer is not None:
        import dataclasses

        config = dataclasses.replace(config, output_vocab=(0, tok.vocab_size))

    def ready(info: EngineReady) -> None:
        if info.events:
            # Say which way the PUB goes: an endpoint without "*" connects (vLLM's rule), and
            # then only a subscriber that binds there hears it.
            mode = "bind" if info.events_binds else "connect"
            replay = f"{info.replay} (bind)" if info.replay else "off"
            extra = f" events {info.events} ({mode}) replay {replay}"
        else:
            extra = " events off"
        print(f"kvstream engine: ready {info.http}{extra} ({config.num_gpu_blocks} blocks x "
              f"{config.block_size} tokens)", flush=True)

    server = EngineServer(config, tok, ev)
    try:
        anyio.run(lambda: server.serve(args.host, args.port, ready, log_level=args.log_level,
                                              timeout_keep_alive=args.timeout_keep_alive), backend_options=_loop_options())
    except OSError as exc:
        print(f"kvstream engine: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:
        print(f"kvstream engine: cannot open the KV event sockets ({exc}); check --kv-events-config's endpoints",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstream engine: stopped", file=sys.stderr)
        return 130
    return 0


def _chat_template(text: str | None) -> str | None:
    """``--chat-template`` as given, after checking that one that looks like a path (no
    Jinja braces) is a readable file, as vLLM checks it; ValueError otherwise."""
    if text is None or "{" in text:
        return text
    from pathlib import Path

    p = Path(text)
    if not p.is_file():
        raise ValueError(f"--chat-template {text!r} looks like a file name but is "
                         f"{'a directory' if p.is_dir() else 'no file'}; give a .jinja file or the template text")
    return text


def _loop_options() -> dict[str, bool]:
    """uvloop (a dependency, not on Windows) when importable: less latency per hop."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
