"""Publisher configuration: vLLM's ``KVEventsConfig`` (same names, same defaults) plus
kvstream's extensions, and the endpoint rules vLLM applies to data-parallel ranks.

vLLM's fields (``enable_kv_cache_events``, ``publisher``, ``endpoint``, ``replay_endpoint``,
``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``) mean exactly what they mean in
``vllm/config/kv_events.py``, so a vLLM config dict can be passed to
:meth:`KVEventsConfig.from_dict` unchanged. Everything after them is a kvstream extension
with a default that behaves like vLLM >= 0.26.

Endpoint rules (vLLM's, checked against vLLM 0.33's ``dp1.bin`` capture):

* The PUB socket **binds** when the endpoint contains ``*`` or ``::`` or is ``ipc://`` or
  ``inproc://``; otherwise it **connects** (a volatile engine connecting to a stable proxy).
  The replay ROUTER always binds.
* Data-parallel rank ``r > 0``: a ``tcp://`` endpoint gets its port increased by ``r``, an
  ``inproc://`` endpoint gets the suffix ``_dp{r}``, and ``ipc://`` is rejected (vLLM raises
  too, less clearly). Rank 0 endpoints are used as given.
* Port 0 (an ephemeral port) depends on the release (``VllmVersion.dp_offsets_port_zero``):
  vLLM 0.11 adds the rank to it like to any port (rank 2 binds port 2), vLLM 0.33 keeps
  ``:0`` so every rank gets its own ephemeral port. ``KVEventsConfig.vllm_version`` picks
  the rule (default ``"0.33"``); a wildcard port ``:*`` always stays a wildcard.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, Mapping

from kvstream.compat import VLLM_0_33, VllmVersion, version as _version
from kvstream.errors import LocalProtocolError

__all__ = [
    "KVEventsConfig",
    "CurveServerConfig",
    "CurveClientConfig",
    "EndpointError",
    "offset_endpoint",
    "should_bind",
    "check_rank_endpoints",
    "QUEUE_FULL_POLICIES",
]

QUEUE_FULL_POLICIES: Final = ("replay_only", "raise")
"""What :meth:`Publisher.publish` does when its send queue is full (see ``queue_full``)."""


class EndpointError(LocalProtocolError, ValueError):
    """An endpoint cannot be used as configured (a local configuration error)."""


@dataclass(frozen=True, slots=True)
class CurveServerConfig:
    """CURVE settings of a publisher (server side of both its sockets).

    ``secret_key``/``public_key`` are the publisher's z85 keypair (40-byte z85 strings, see
    :func:`kvstream.transport.curve.generate_keypair`). ``allowed_clients``: z85 public keys
    of the subscribers allowed to connect; None accepts any client that knows the server's
    public key (traffic is still encrypted, but not authenticated).
    """

    secret_key: bytes
    public_key: bytes
    allowed_clients: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class CurveClientConfig:
    """CURVE settings of a subscriber: its own z85 keypair and the publisher's public key
    (the subscriber refuses any server that does not hold the matching secret key)."""

    server_public_key: bytes
    secret_key: bytes
    public_key: bytes


@dataclass(slots=True)
class KVEventsConfig:
    """Configuration of a KV event publisher; names and defaults match vLLM's ``KVEventsConfig``."""

    enable_kv_cache_events: bool = False
    """vLLM's switch for emitting KV events. A :class:`Publisher` publishes whatever it is
    given regardless; the field exists so that vLLM configs round-trip."""
    publisher: Literal["null", "zmq"] | None = None
    """``"zmq"`` or ``"null"``; None means ``"zmq"`` if events are enabled else ``"null"``
    (vLLM 0.33's rule; under ``vllm_version="0.11"`` None means ``"null"``, as in 0.11)."""
    endpoint: str = "tcp://*:5557"
    """PUB socket endpoint (bind/connect rule in the module docstring)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint answering replay requests; None disables replay."""
    buffer_steps: int = 10_000
    """How many past batches (not events) are kept for replay."""
    hwm: int = 100_000
    """ZMQ send high-water mark of the PUB socket (messages per subscriber); beyond it,
    ZMQ drops messages for that subscriber, which it then detects as a gap."""
    max_queue_size: int = 100_000
    """Bound of the publisher's send queue (batches); what happens when it is full is
    ``queue_full``."""
    topic: str = ""
    """Topic frame of every live message; subscribers filter on it by prefix."""

    # -- kvstream extensions -----------------------------------------------------------
    encoding: Literal["map", "array"] = "map"
    """Payload shape: ``"map"`` (vLLM >= 0.26) or ``"array"`` (vLLM 0.11)."""
    replay_topic_frame: bool = True
    """Replay replies carry the topic frame (vLLM >= 0.26, 4 frames at the DEALER) or not
    (vLLM 0.11, 3 frames)."""
    queue_full: Literal["replay_only", "raise"] = "replay_only"
    """Policy when ``max_queue_size`` batches are waiting to be sent. ``"replay_only"``: the
    batch still gets its seq and enters the replay buffer but is not sent live (counted in
    ``stats.live_dropped``); subscribers see a gap and fetch it by replay. ``"raise"``:
    :meth:`Publisher.publish` raises :class:`QueueFullError` and the batch is not published."""
    max_replay_jobs: int = 256
    """Replay/snapshot requests answered concurrently (at most one per requester); others
    wait (see ``max_pending_replays``)."""
    max_pending_replays: int = 1024
    """Requests waiting for a free job slot; more are ignored and counted
    (``stats.replay_rejected``), the requester's retry comes later."""
    replay_chunk: int = 256
    """Replay messages sent to one requester per round before the next requester's turn."""
    replay_slice_s: float = 0.002
    """Seconds of event-loop time the replay server takes per turn before yielding (bounds
    how late an engine loop sharing the event loop can be made by replays)."""
    replay_hwm: int = 10_000
    """ZMQ send high-water mark of the replay socket (messages per requester)."""
    replay_client_max_bytes: int = 4 * 1024 * 1024
    """Reply bytes one requester may have queued in ZMQ and not yet read (plus one message)."""
    replay_max_bytes: int = 64 * 1024 * 1024
    """Reply bytes all requesters together may have queued in ZMQ and not yet read."""
    replay_client_timeout_s: float = 5.0
    """Seconds a requester may read nothing while its replay waits on it; then the replay
    is dropped (``stats.replay_stalled``)."""
    snapshot_reuse_s: float = 0.1
    """Snapshot requests within this many seconds of the last call of the snapshot provider
    share its state (tagged with its seq; the requester replays what followed)."""
    max_snapshot_states: int = 2
    """Distinct snapshot states held at once (each about the size of the pool's state)."""
    snapshot_batch_events: int = 512
    """Events per batch in a snapshot reply."""
    linger_s: float = 1.0
    """Seconds ZMQ keeps trying to deliver queued messages after the publisher closes."""
    data_parallel_size: int | None = None
    """Number of DP ranks, if known: lets the port-collision check cover every rank at
    startup instead of only ranks up to this one."""
    curve: CurveServerConfig | None = field(default=None, repr=False)
    """CURVE encryption/authentication for tcp endpoints; None (default, like vLLM) is plaintext."""
    vllm_version: str = VLLM_0_33.name
    """The vLLM release whose endpoint rules apply (``"0.11"`` or ``"0.33"``, see
    :mod:`kvstream.compat`): decides whether a data-parallel rank offsets port 0."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            # vLLM 0.33's __post_init__; vLLM 0.11 has none: its default is "null" even
            # with events enabled (it publishes only with publisher="zmq").
            enabled = self.enable_kv_cache_events and _version(self.vllm_version).name != "0.11"
            self.publisher = "zmq" if enabled else "null"
        if self.buffer_steps < 0:
            raise ValueError(f"buffer_steps must be >= 0, got {self.buffer_steps}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if self.hwm < 0:
            raise ValueError(f"hwm must be >= 0 (0 = unlimited), got {self.hwm}")
        if self.encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', got {self.encoding!r}")
        if self.queue_full not in QUEUE_FULL_POLICIES:
            raise ValueError(f"queue_full must be one of {QUEUE_FULL_POLICIES}, got {self.queue_full!r}")
        for name in ("max_replay_jobs", "max_pending_replays", "replay_chunk", "snapshot_batch_events",
                     "replay_hwm", "replay_client_max_bytes", "replay_max_bytes", "max_snapshot_states"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("replay_slice_s", "replay_client_timeout_s", "snapshot_reuse_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        self.vllm_version = _version(self.vllm_version).name  # raises naming the known releases

    @property
    def vllm(self) -> VllmVersion:
        """The :class:`~kvstream.compat.VllmVersion` named by ``vllm_version``."""
        return _version(self.vllm_version)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVEventsConfig":
        """Build from a dict such as ``dataclasses.asdict(vllm_config)``; unknown keys are
        an error naming the accepted ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown KVEventsConfig keys {unknown}; accepted: {sorted(names)}")
        return cls(**dict(d))


def should_bind(endpoint: str) -> bool:
    """vLLM's heuristic: bind a wildcard (``*``, ``::``), ``ipc://`` or ``inproc://``
    endpoint, connect anything else."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


def _split_tcp(endpoint: str) -> tuple[str, str]:
    i = endpoint.rfind(":")
    if i < len("tcp://"):
        raise EndpointError(f"tcp endpoint {endpoint!r} has no port; write it as tcp://HOST:PORT")
    return endpoint[:i], endpoint[i + 1:]


def offset_endpoint(endpoint: str | None, rank: int, vllm: VllmVersion | str = VLLM_0_33) -> str | None:
    """The endpoint data-parallel rank ``rank`` uses, by the rule of release ``vllm``
    (a :class:`~kvstream.compat.VllmVersion` or its name; module docstring).

    A wildcard port (``tcp://127.0.0.1:*``) stays a wildcard: every bind gets its own port.
    Port 0 is offset under vLLM 0.11 and kept under 0.33 (the default).
    Raises :class:`EndpointError` for ``ipc://`` with ``rank > 0`` or an unknown scheme.
    """
    if isinstance(vllm, str):
        vllm = _version(vllm)
    if rank < 0:
        raise EndpointError(f"data_parallel_rank must be >= 0, got {rank}")
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, port = _split_tcp(endpoint)
        if port == "*":
            return endpoint
        try:
            p = int(port)
        except ValueError:
            raise EndpointError(f"tcp endpoint {endpoint!r} has a non-numeric port {port!r}") from None
        if p == 0 and not vllm.dp_offsets_port_zero:
            return endpoint
        return f"{base}:{p + rank}"
    if endpoint.startswith("ipc://"):
        raise EndpointError(
            f"endpoint {endpoint!r} cannot be used by data_parallel_rank {rank}: ipc paths have no "
            "port to offset, so every rank would share one socket file. Use a tcp://HOST:PORT "
            "endpoint (rank r uses PORT+r) or an inproc:// endpoint (rank r gets suffix _dp{r})."
        )
    raise EndpointError(f"endpoint {endpoint!r}: scheme must be tcp://, ipc:// or inproc://")


def _tcp_port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        return int(_split_tcp(endpoint)[1])
    except ValueError:
        return None


def check_rank_endpoints(config: KVEventsConfig, rank: int) -> tuple[str, str | None]:
    """The (PUB, replay) endpoints of ``rank``, after checking that no rank's PUB port lands
    on a rank's replay port (``tcp://*:5557`` with replay ``tcp://*:5558`` collides at
    rank 1). Checks every rank when ``config.data_parallel_size`` is set, else ranks
    ``0..rank``. Raises :class:`EndpointError` naming both ports and the fix."""
    vllm = config.vllm
    pub = offset_endpoint(config.endpoint, rank, vllm)
    replay = offset_endpoint(config.replay_endpoint, rank, vllm)
    assert pub is not None
    p0, r0 = _tcp_port(config.endpoint), _tcp_port(config.replay_endpoint)
    if not vllm.dp_offsets_port_zero:
        # An ephemeral port that stays 0 at every rank never collides with anything.
        p0 = None if p0 == 0 else p0
        r0 = None if r0 == 0 else r0
    if p0 is not None and r0 is not None:
        n = config.data_parallel_size if config.data_parallel_size else rank + 1
        # The lowest rank whose PUB port equals some rank's replay port (port 0, kept by
        # rank 0 under every release, is ephemeral: never a collision).
        bad = next((r for r in range(n) if 0 <= p0 + r - r0 < n and p0 + r != 0), None)
        if bad is not None:
            raise EndpointError(
                f"data_parallel_rank {bad} would publish on port {p0 + bad}, which is the replay "
                f"port of rank {p0 + bad - r0} (endpoint {config.endpoint!r}, replay_endpoint "
                f"{config.replay_endpoint!r}, {n} rank(s), vLLM {vllm.name} port rules). Ports are "
                f"offset by rank, so put the replay port at least {n} away from the PUB port, e.g. "
                f"replay port {p0 + max(n, 100)}."
            )
    return pub, replay
