"""``kvstream serve``'s configuration: one typed object, from flags and a TOML file that use
the same names (``--load-interval 2`` on the command line is ``load-interval = 2`` in the
file). Flags given on the command line win over the file; engines from both are followed.

Engines use the ``subscribe``/``record`` syntax plus an optional ``http=URL`` part (the
engine's base URL, for its OpenAI API and ``/metrics``)::

    e0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558,http=http://10.0.0.1:8000

A file::

    engines = ["e0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558,http=http://10.0.0.1:8000"]
    port = 8080
    load-interval = 2.0
    queue-weight = 0.1
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from kvstream.service.errors import ConfigError
from kvstream.transport.subscriber import SourceSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found]

__all__ = ["EngineSpec", "ServeConfig", "parse_engine", "load_file", "ENGINE_SYNTAX", "check_endpoint",
           "is_loopback", "SOCKETS_PER_ENGINE", "FDS_PER_ENGINE"]

ENGINE_SYNTAX = ("[NAME=]PUB[,REPLAY][,http=URL][,forwarded=yes], "
                 "e.g. e0=tcp://h:5557,tcp://h:5558,http=http://h:8000")

SOCKETS_PER_ENGINE = 6
"""ZMQ sockets one followed engine may hold at once: its SUB, the SUB's monitor (a pair of
sockets), its replay DEALER, a fresh DEALER while the old one is reaped, and the check of
its replay endpoint when it is added."""

FDS_PER_ENGINE = 8
"""File descriptors one followed engine may hold: one per ZMQ socket (its mailbox) and one
per TCP connection (live and replay)."""

_BIND_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def check_endpoint(endpoint: str, what: str = "endpoint") -> str | None:
    """Why ``endpoint`` cannot be an engine endpoint that ``kvstream serve`` connects to (a
    sentence naming the fix), or None if it can: ``tcp://HOST:PORT`` (HOST not a bind
    address, PORT 1..65535), ``ipc:///PATH``, or ``nats://`` (a JetStream source). The host
    is not resolved here: the subscriber connects (and resolves) in the background."""
    if endpoint.startswith("nats://"):
        return None
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return f"{what} {endpoint!r} is not an endpoint; write it as tcp://HOST:PORT, e.g. tcp://10.0.0.1:5557"
    if scheme in ("http", "https"):
        return (f"{what} {endpoint!r} is an HTTP URL; the KV event stream is the engine's ZMQ endpoint "
                f"tcp://HOST:PORT (its HTTP base URL goes in the http=URL part)")
    if scheme == "ipc":
        return None if rest else f"{what} {endpoint!r} has no path; write it as ipc:///PATH"
    if scheme != "tcp":
        return (f"{what} {endpoint!r}: scheme {scheme!r} is not supported; engines publish on tcp://HOST:PORT "
                "(or ipc:///PATH)")
    host, colon, port = rest.rpartition(":")
    if not colon or not host or "]" in port:
        return f"{what} {endpoint!r} has no port; write it as tcp://HOST:PORT, e.g. tcp://10.0.0.1:5557"
    if host in _BIND_HOSTS:
        return (f"{what} {endpoint!r} is a bind address (all interfaces); kvstream serve connects to the "
                f"engine, so give the engine's host, e.g. tcp://10.0.0.1:{port}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{what} {endpoint!r}: port {port!r} is not a port number (1-65535)"
    return None


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only: a loopback address
    (``127.0.0.0/8``, ``::1``) or ``localhost``. Any other address or name (``0.0.0.0``,
    ``::``, an interface's address, a host name) is taken as routable."""
    import ipaddress

    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine to follow: its event stream (``source``) and optional HTTP base URL."""

    source: SourceSpec
    http: str | None = None

    @property
    def name(self) -> str:
        """The engine's name (the source name)."""
        return self.source.source


def parse_engine(text: str) -> EngineSpec:
    """Parse one ENGINE argument (:data:`ENGINE_SYNTAX`): the ``subscribe``/``record``
    endpoint forms (``[NAME=]PUB[,REPLAY]``, options ``replay=``, ``name=``) plus
    ``http=URL``. Raises :class:`ConfigError` saying what is wrong."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f"an engine must be a non-empty string like {ENGINE_SYNTAX}, got {text!r}")
    name: str | None = None
    body = text
    head, sep, _ = text.partition("://")
    if sep and "=" in head:
        name, body = text.split("=", 1)
    parts = body.split(",")
    pub, replay, http = parts[0], None, None
    forwarded = False
    for o in parts[1:]:
        key, eq, value = o.partition("=")
        if eq and "://" not in key:
            if key not in ("replay", "name", "http", "forwarded") or not value:
                raise ConfigError(f"bad option {o!r} in {text!r}; expected {ENGINE_SYNTAX}")
            if key == "replay":
                replay = value
            elif key == "name":
                name = value
            elif key == "forwarded":
                if value.lower() not in ("yes", "true", "1", "no", "false", "0"):
                    raise ConfigError(f"forwarded= takes yes or no, got {value!r} in {text!r}")
                forwarded = value.lower() in ("yes", "true", "1")
            else:
                if http is not None:
                    raise ConfigError(f"two http= parts in {text!r}; give one base URL per engine")
                if not value.startswith(("http://", "https://")) or len(value) <= len("http://"):
                    raise ConfigError(f"http= must be an http:// or https:// base URL, got {value!r} in {text!r}")
                http = value.rstrip("/")
        elif "://" in o and replay is None:
            replay = o
        else:
            raise ConfigError(f"unexpected {o!r} in {text!r}; expected {ENGINE_SYNTAX}")
    if "://" not in pub:
        raise ConfigError(f"{pub!r} is not an endpoint; write it as tcp://HOST:PORT (expected {ENGINE_SYNTAX})")
    for what, ep in (("endpoint", pub), ("replay endpoint", replay)):
        why = check_endpoint(ep, what) if ep else None
        if why is not None:
            raise ConfigError(f"engine {text!r}: {why}")
    if name == "":
        raise ConfigError(f"empty engine name in {text!r}")
    return EngineSpec(SourceSpec(pub, replay or None, name or None, forwarded=forwarded), http)


class _File(msgspec.Struct, forbid_unknown_fields=True, rename="kebab", omit_defaults=True):
    engines: list[str] | UnsetType = UNSET
    host: str | UnsetType = UNSET
    port: int | UnsetType = UNSET
    log_format: Literal["text", "json"] | UnsetType = UNSET
    log_level: Literal["debug", "info", "warning", "error"] | UnsetType = UNSET
    tokenizer: str | UnsetType = UNSET
    load_interval: float | UnsetType = UNSET
    max_prompt_tokens: int | UnsetType = UNSET
    max_body_bytes: int | UnsetType = UNSET
    router_block_size: int | UnsetType = UNSET
    index_table: Literal["dict", "compact"] | UnsetType = UNSET
    scoring: Literal["prefix", "cost"] | UnsetType = UNSET
    index_max_bytes: int | UnsetType = UNSET
    index_ttl: float | UnsetType = UNSET
    speculate_ttl: float | UnsetType = UNSET
    prefix_weight: float | UnsetType = UNSET
    queue_weight: float | UnsetType = UNSET
    running_weight: float | UnsetType = UNSET
    kv_weight: float | UnsetType = UNSET
    register_token_file: str | UnsetType = UNSET
    topic: str | UnsetType = UNSET
    replay_timeout: float | UnsetType = UNSET
    mooncake_seed: int | UnsetType = UNSET
    model_name: str | UnsetType = UNSET
    peers: list[str] | UnsetType = UNSET
    max_dump_bytes: int | UnsetType = UNSET
    request_timeout: float | UnsetType = UNSET
    peer_timeout: float | UnsetType = UNSET
    # The weights' current names (the flags'); prefix-weight and kv-weight above are the
    # older spellings, still read.
    kv_overlap_score_weight: float | UnsetType = UNSET
    kv_usage_weight: float | UnsetType = UNSET
    ext_proc_port: int | UnsetType = UNSET
    max_engines: int | UnsetType = UNSET
    insecure_open_admin: bool | UnsetType = UNSET


_FILE_ALIASES = {"kv_overlap_score_weight": "prefix_weight", "kv_usage_weight": "kv_weight"}
"""File keys read into another attribute: current name -> the attribute (older key)."""

FILE_KEYS = tuple(_File.__struct_encode_fields__)
"""Every key a config file may hold (the flag names without ``--``)."""

MAX_ENGINES_LIMIT = 10_000
"""The largest ``max_engines`` accepted (each engine holds :data:`SOCKETS_PER_ENGINE`
sockets and :data:`FDS_PER_ENGINE` file descriptors)."""


@dataclass(slots=True)
class ServeConfig:
    """Everything ``kvstream serve`` needs; the defaults are the flags' defaults.

    Attributes (flag / file key in parentheses):
        engines: engines to follow (ENGINE... / ``engines``).
        host, port: listen address (``--host``, ``--port``; port 0: any free port).
        log_format: ``text`` or ``json`` (one JSON object per line) (``--log-format``).
        log_level: ``debug``, ``info``, ``warning`` or ``error`` (``--log-level``).
        tokenizer: a local ``tokenizer.json`` or a folder holding one, for ``prompt``
            requests (``--tokenizer``); None: only ``token_ids`` requests.
        load_interval: seconds between scrapes of each engine's ``/metrics``; 0 disables
            (``--load-interval``).
        max_prompt_tokens: longest prompt accepted, tokens (``--max-prompt-tokens``).
        max_body_bytes: largest request body accepted, bytes (``--max-body-bytes``).
        request_timeout: seconds a connection may hold a partial request (head or body)
            before it is answered 408 and closed (``--request-timeout``).
        router_block_size: tokens per router block of the default index
            (``--router-block-size``).
        index_table: block table of the token-keyed indexes (``--index-table``): ``dict``
            (default, fastest ingest, ~150 B per block) or ``compact`` (~100 B per block).
        index_max_bytes: memory bound of each index, bytes (``--index-max-bytes``).
        index_ttl: seconds a block lives after its last store (``--index-ttl``).
        speculate_ttl: seconds a ``"speculate": true`` insert lives (``--speculate-ttl``).
        scoring: how engines are ranked (``--scoring``): ``prefix`` (default,
            :class:`~kvstream.routing.scoring.PrefixLoadPolicy` with the weights below) or
            ``cost`` (:class:`~kvstream.routing.scoring.CostPolicy`, the placement model).
        prefix_weight, queue_weight, running_weight, kv_weight: the scoring weights of
            :class:`~kvstream.routing.scoring.PrefixLoadPolicy`.
        register_token_file: a file holding the bearer token that ``/register``,
            ``/unregister`` and ``GET /v1/dump`` require (None: no token; then only allowed
            on a loopback ``host`` or with ``insecure_open_admin``) (``--register-token-file``).
        insecure_open_admin: serve ``/register``, ``/unregister`` and ``/v1/dump`` without a
            token on a routable ``host`` (``--insecure-open-admin``); without it, such a
            host needs ``register_token_file``.
        max_engines: most engines followed at once, configured and registered together
            (``--max-engines``); a ``/register`` beyond it is refused (429). Registration
            groups are dropped once empty, so there are at most this many of them too.
        topic: topic prefix to subscribe to (``--topic``).
        replay_timeout: seconds of silence before a replay request is retried.
        mooncake_seed: seed ``S`` of the standard XXH3-64 hash (RFC #1527) for Mooncake
            publishers (``--mooncake-seed``).
        model_name: the model the configured engines serve: the Mooncake ``/query`` API
            answers for them under this ``model``, tenant ``default``, ``block_size`` =
            ``router_block_size`` (``--model-name``).
        peers: base URLs of running replicas; at startup the first that answers
            ``GET /v1/dump`` gives the index and each engine's last applied seq
            (``--peers``).
        max_dump_bytes: largest peer dump read, bytes; a peer sending more is skipped
            (``--max-dump-bytes``).
        peer_timeout: seconds for one peer's whole dump (connect, headers, body); a peer
            slower than that is skipped (``--peer-timeout``).
        ext_proc_port: port of the gRPC endpoint picker for an Inference Gateway
            (Envoy's ext_proc protocol; docs/gateway.md) on ``host``; None: none, 0: any
            free port (``--ext-proc-port``).
        config_file: the TOML file the rest came from, if any (``--config``).
    """

    engines: list[EngineSpec]
    host: str = "127.0.0.1"
    port: int = 8080
    log_format: str = "text"
    log_level: str = "info"
    tokenizer: str | None = None
    load_interval: float = 2.0
    max_prompt_tokens: int = 262_144
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout: float = 60.0
    router_block_size: int = 16
    index_table: str = "dict"
    index_max_bytes: int | None = None
    index_ttl: float | None = None
    speculate_ttl: float = 2.0
    scoring: str = "prefix"
    prefix_weight: float = 1.0
    queue_weight: float = 0.1
    running_weight: float = 0.02
    kv_weight: float = 0.2
    register_token_file: str | None = None
    topic: str = ""
    replay_timeout: float = 2.0
    mooncake_seed: int = 0
    model_name: str = "default"
    peers: list[str] | None = None
    max_dump_bytes: int = 1024 * 1024 * 1024
    peer_timeout: float = 30.0
    ext_proc_port: int | None = None
    max_engines: int = 256
    insecure_open_admin: bool = False
    config_file: str | None = None

    def check(self) -> "ServeConfig":
        """Validate values; raises :class:`ConfigError` naming the setting and the fix."""
        def need(ok: bool, name: str, what: str, value: Any) -> None:
            if not ok:
                raise ConfigError(f"{name} must be {what}, got {value!r}")

        need(0 <= self.port <= 65535, "port", "0..65535", self.port)
        need(self.ext_proc_port is None or 0 <= self.ext_proc_port <= 65535, "ext-proc-port", "0..65535",
             self.ext_proc_port)
        need(self.load_interval >= 0, "load-interval", "seconds >= 0 (0: no scraping)", self.load_interval)
        need(self.max_prompt_tokens > 0, "max-prompt-tokens", "a positive token count", self.max_prompt_tokens)
        need(self.max_body_bytes >= 1024, "max-body-bytes", "at least 1024 bytes", self.max_body_bytes)
        need(self.router_block_size > 0, "router-block-size", "a positive token count", self.router_block_size)
        need(self.index_table in ("dict", "compact"), "index-table", "'dict' or 'compact'", self.index_table)
        need(self.scoring in ("prefix", "cost"), "scoring", "'prefix' or 'cost'", self.scoring)
        need(self.index_max_bytes is None or self.index_max_bytes > 0, "index-max-bytes", "positive bytes",
             self.index_max_bytes)
        need(self.index_ttl is None or self.index_ttl > 0, "index-ttl", "positive seconds", self.index_ttl)
        need(self.speculate_ttl > 0, "speculate-ttl", "positive seconds", self.speculate_ttl)
        need(self.request_timeout > 0, "request-timeout", "positive seconds", self.request_timeout)
        need(self.max_dump_bytes >= 1024, "max-dump-bytes", "at least 1024 bytes", self.max_dump_bytes)
        need(self.peer_timeout > 0, "peer-timeout", "positive seconds", self.peer_timeout)
        need(self.replay_timeout > 0, "replay-timeout", "positive seconds", self.replay_timeout)
        need(0 <= self.mooncake_seed < 2**64, "mooncake-seed", "an unsigned 64-bit int", self.mooncake_seed)
        need(1 <= self.max_engines <= MAX_ENGINES_LIMIT, "max-engines", f"1..{MAX_ENGINES_LIMIT}", self.max_engines)
        need(self.log_format in ("text", "json"), "log-format", "text or json", self.log_format)
        need(self.log_level in ("debug", "info", "warning", "error"), "log-level",
             "debug, info, warning or error", self.log_level)
        names = [e.name for e in self.engines]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"engine names must be unique, {dup} given twice; name them NAME=tcp://...")
        if len(self.engines) > self.max_engines:
            raise ConfigError(f"{len(self.engines)} engines are configured, more than max-engines {self.max_engines}; "
                              "raise --max-engines")
        self.register_token()  # a token file that cannot be read is a start-up error, not a first-request one
        if not is_loopback(self.host) and self.register_token_file is None and not self.insecure_open_admin:
            raise ConfigError(f"host {self.host!r} is reachable from other machines, and /register, /unregister and "
                              "/v1/dump would answer anyone there: give --register-token-file FILE (a bearer token "
                              "they then need), or --insecure-open-admin to leave them open")
        for p in self.peers or ():
            if not p.startswith(("http://", "https://")):
                raise ConfigError(f"peers must be http:// URLs of running replicas, got {p!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise ConfigError(f"tokenizer {self.tokenizer!r} does not exist; give a local tokenizer.json "
                              "or a model folder holding one (nothing is downloaded)")
        return self

    def register_token(self) -> str | None:
        """The bearer token from :attr:`register_token_file` (None: none configured)."""
        if self.register_token_file is None:
            return None
        try:
            tok = Path(self.register_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read register-token-file {self.register_token_file!r}: {exc}") from None
        if not tok:
            raise ConfigError(f"register-token-file {self.register_token_file!r} is empty")
        return tok


def load_file(path: str) -> dict[str, Any]:
    """Read a TOML config file into ``{attribute: value}`` (only the keys it sets; engines
    parsed). Raises :class:`ConfigError` saying which key is wrong and why."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    try:
        parsed = msgspec.convert(raw, _File)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if "unknown field" in msg:
            msg += f"; known keys: {', '.join(FILE_KEYS)}"
        raise ConfigError(f"config file {path!r}: {msg}") from None
    out: dict[str, Any] = {}
    for f in _File.__struct_fields__:
        v = getattr(parsed, f)
        if v is not UNSET:
            attr = _FILE_ALIASES.get(f, f)
            if attr in out:
                raise ConfigError(f"config file {path!r} sets both {f.replace('_', '-')} and its older "
                                  f"spelling {attr.replace('_', '-')}; keep {f.replace('_', '-')}")
            out[attr] = v
    if "engines" in out:
        try:
            out["engines"] = [parse_engine(e) for e in out["engines"]]
        except ConfigError as exc:
            raise ConfigError(f"config file {path!r}: {exc}") from None
    return out


def build_config(cli: dict[str, Any], cli_engines: list[str], config_file: str | None) -> ServeConfig:
    """The config from flags (``cli``: attribute -> value for flags given, None values
    ignored) over the file's values over the defaults; engines from both. Raises
    :class:`ConfigError`."""
    values: dict[str, Any] = load_file(config_file) if config_file else {}
    engines = list(values.pop("engines", []))
    engines += [parse_engine(e) for e in cli_engines]
    for k, v in cli.items():
        if v is not None:
            values[k] = v
    return ServeConfig(engines=engines, config_file=config_file, **values).check()
