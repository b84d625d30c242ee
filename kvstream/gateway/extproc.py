"""Envoy's external processing service (``envoy.service.ext_proc.v3.ExternalProcessor``)
over an :class:`~kvstream.gateway.picker.EndpointPicker`: kvstream as the endpoint picker
(EPP) of an Inference Gateway, as the Gateway API Inference Extension's endpoint picker
protocol defines it.

The messages are the classes ``xds-protos`` generates from Envoy's API; the server is
grpcio's asyncio one, so it runs in ``kvstream serve``'s event loop beside the HTTP API::

    async with ExtProcServer(picker, "127.0.0.1", 9002) as server:
        ...   # server.port: the bound port

Per ext_proc stream (one per HTTP request and filter):

* the request body (buffered mode; its path from the ``request.path`` attribute or the
  ``:path`` header, the endpoint subset from the filter metadata
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``) gets the pick:
  the request headers ``x-gateway-destination-endpoint: IP:PORT[,IP:PORT...]`` (the
  engines to try, best first), ``x-kvstream-engine: NAME`` and ``x-kvstream-pick: ID``,
  and the same endpoints in the dynamic metadata ``envoy.lb`` /
  ``x-gateway-destination-endpoint``; or an ``ImmediateResponse`` (400 with vLLM's error
  body for a malformed OpenAI request; 503 if no allowed endpoint is an engine).
* the response headers and body, seen by the same stream or by a second ext_proc filter in
  observability mode (matched to the pick by ``x-kvstream-pick``), end the request's
  count: in flight, served, routing accuracy. The engine that served it comes from the
  ``x-gateway-destination-endpoint-served`` response header or metadata.

Nothing here fails a request: an internal error is logged and the request goes on
without a pick (the gateway balances it by its own policy).
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

from kvstream.gateway.picker import EndpointPicker, Exchange, Pick, Refusal
from kvstream.transport.lifetime import Lifetime

__all__ = ["ExtProcServer", "PICK_HEADER", "DESTINATION_HEADER", "SERVED_KEY", "SUBSET_NAMESPACE", "SUBSET_KEY",
           "METADATA_NAMESPACE", "ENGINE_HEADER"]

log = logging.getLogger("kvstream.gateway")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Request header (and ``envoy.lb`` dynamic metadata key) naming the picked endpoints."""
SERVED_KEY = "x-gateway-destination-endpoint-served"
"""Response header or ``envoy.lb`` metadata key naming the endpoint that answered."""
METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
ENGINE_HEADER = "x-kvstream-engine"
"""Request header naming the engine picked first."""
PICK_HEADER = "x-kvstream-pick"
"""Request header carrying the pick's id to an observing ext_proc filter."""

_SWEEP_S = 1.0
_STREAMED = 1  # envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode.STREAMED


def _pb() -> Any:
    try:
        from envoy.service.ext_proc.v3 import external_processor_pb2
    except ImportError as exc:  # pragma: no cover - the gateway extra is missing
        raise ImportError("--ext-proc-port needs grpcio and xds-protos: pip install 'kvstream[gateway]'") from exc
    return external_processor_pb2


def _header(headers: Any, name: str) -> str | None:
    for h in headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return None


def _attribute(req: Any, name: str) -> str | None:
    for struct in req.attributes.values():
        v = struct.fields.get(name)
        if v is not None and v.WhichOneof("kind") == "string_value":
            return str(v.string_value)
    return None


def _subset(req: Any) -> list[str] | None:
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    v = ns.fields[SUBSET_KEY]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return [x.string_value for x in v.list_value.values if x.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [s.strip() for s in v.string_value.split(",") if s.strip()]
    return []


def _served(req: Any, headers: Any) -> str | None:
    v = _header(headers, SERVED_KEY)
    if v:
        return v
    if req.HasField("metadata_context"):
        ns = req.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
        if ns is not None and SERVED_KEY in ns.fields:
            return str(ns.fields[SERVED_KEY].string_value) or None
    return None


class _Servicer:
    """The ``Process`` RPC: one bidirectional stream per HTTP request and filter."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.pb = _pb()
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
        from envoy.type.v3 import http_status_pb2
        from google.protobuf import struct_pb2

        self.base = base_pb2
        self.status = http_status_pb2
        self.struct = struct_pb2
        self.grpc = external_processor_pb2_grpc
        pb = self.pb
        self._continue = {
            "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
            "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
            "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
            "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
            "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
            "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
        }

    def _set(self, key: str, value: str) -> Any:
        b = self.base
        return b.HeaderValueOption(header=b.HeaderValue(key=key, raw_value=value.encode("latin-1")),
                                   append_action=b.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)

    def _answer(self, phase: str, out: Pick | Refusal | None) -> Any:
        pb = self.pb
        if out is None:
            return self._continue[phase]
        if isinstance(out, Refusal):
            return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status=self.status.HttpStatus(code=out.status), body=out.body,
                headers=pb.HeaderMutation(set_headers=[self._set("content-type", "application/json")]),
                details=f"kvstream_refused_{out.status}"))
        mutation = pb.HeaderMutation(set_headers=[
            self._set(DESTINATION_HEADER, out.value), self._set(ENGINE_HEADER, out.engine),
            self._set(PICK_HEADER, out.id)])
        common = pb.CommonResponse(header_mutation=mutation)
        meta = self.struct.Struct()
        meta.update({METADATA_NAMESPACE: {DESTINATION_HEADER: out.value}})
        if phase == "request_headers":
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)

    async def Process(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        picker = self.picker
        ex: Exchange | None = None
        path: str | None = None
        subset: list[str] | None = None
        picked = False
        mine = False  # this stream follows the answer (it claimed the pick)
        # Streamed request body sent without waiting for the headers' answer: the headers
        # are answered (with the pick) once the whole body is in, then each chunk.
        held: list[bytes] | None = None
        held_bytes = 0
        try:
            async for req in requests:
                phase = req.WhichOneof("request")
                observe = req.observability_mode
                out: list[Any] | None = None
                try:
                    if phase == "request_headers":
                        h = req.request_headers
                        path = _attribute(req, "request.path") or _header(h, ":path")
                        subset = _subset(req)
                        pc = req.protocol_config
                        if observe:
                            pid = _header(h, PICK_HEADER)
                            ex = picker.claim(pid) if pid else None
                            mine = ex is not None
                        elif h.end_of_stream and not picked:  # no body: pick now, by load
                            picked = True
                            result = picker.request(path, b"", subset)
                            ex = result.exchange if isinstance(result, Pick) else None
                            out = [self._answer(phase, result)]
                        elif pc.send_body_without_waiting_for_header_response and pc.request_body_mode == _STREAMED:
                            held, out = [], []
                    elif phase == "request_body" and not observe and held is not None:
                        chunk = req.request_body.body
                        held.append(chunk)
                        held_bytes += len(chunk)
                        out = []
                        if held_bytes > picker.max_body_bytes:  # too large to read: no pick, let it go
                            out = [self._continue["request_headers"]] + [self._continue[phase]] * len(held)
                            held = None
                            picked = True
                        elif req.request_body.end_of_stream:
                            picked = True
                            result = picker.request(path, b"".join(held), subset)
                            ex = result.exchange if isinstance(result, Pick) else None
                            out = [self._answer("request_headers", result)]
                            if not isinstance(result, Refusal):
                                out += [self._continue[phase]] * len(held)
                            held = None
                    elif phase == "request_body" and not observe and not picked:
                        picked = True
                        result = picker.request(path or _attribute(req, "request.path"), req.request_body.body,
                                                subset if subset is not None else _subset(req))
                        ex = result.exchange if isinstance(result, Pick) else None
                        out = [self._answer(phase, result)]
                    elif phase == "response_headers" and ex is None and observe:
                        # An observer of the answers alone: the pick's id came back with it.
                        h = req.response_headers
                        pid = _header(h, PICK_HEADER)
                        ex = picker.claim(pid) if pid else None
                        if ex is not None:
                            mine = True
                            status = _header(h, ":status")
                            ex.headers(int(status) if status and status.isdigit() else None,
                                       _header(h, "content-type") or "", _served(req, h))
                            if h.end_of_stream:
                                ex.end()
                    elif phase == "response_headers" and ex is not None and (mine or not ex.claimed):
                        if not mine:  # the picking stream sees the answer too (one filter)
                            picker.claim(ex.id)
                            mine = True
                        h = req.response_headers
                        status = _header(h, ":status")
                        ex.headers(int(status) if status and status.isdigit() else None,
                                   _header(h, "content-type") or "", _served(req, h))
                        if h.end_of_stream:
                            ex.end()
                    elif phase == "response_body" and ex is not None and mine:
                        ex.body(req.response_body.body, req.response_body.end_of_stream)
                    elif phase == "response_trailers" and ex is not None and mine:
                        ex.end()
                except Exception:  # noqa: BLE001 - a bug here must not fail the request
                    log.exception("ext_proc: error handling a %s message; the request goes on without a pick", phase)
                    out = None
                    if held is not None:  # answer what was held back, unchanged
                        out = [self._continue["request_headers"]] + [self._continue["request_body"]] * len(held)
                        held = None
                        picked = True
                if observe:
                    continue
                if out is None:
                    yield self._continue[phase or "request_headers"]
                else:
                    for o in out:
                        yield o
        finally:
            # The stream ended (the request is over, or Envoy gave up on it): whatever was
            # not counted yet is counted now, once. A pick still waiting for an observing
            # stream keeps waiting (up to the picker's unclaimed_s).
            if ex is not None and mine:
                ex.end()


HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
"""The gRPC health services the endpoint picker protocol names (``liveness``: the process
answers; the other two: ``ready()`` says so)."""


class ExtProcServer:
    """The gRPC server, an ``async with`` resource: listens on ``host:port`` (0: a free
    port; ``port`` holds the bound one) once entered, stops (waiting up to ``grace_s``
    seconds for open streams) on exit. ``max_message_bytes``: largest message taken (a
    buffered request body; default the picker's body limit plus 64 KiB).

    It also serves the gRPC Health Checking Protocol (``grpc.health.v1.Health``) for
    :data:`HEALTH_SERVICES`: ``readiness`` and the ext_proc service are ``SERVING`` while
    ``ready()`` is true (checked every second; None: always), else ``NOT_SERVING``."""

    def __init__(self, picker: EndpointPicker, host: str = "127.0.0.1", port: int = 0, *, grace_s: float = 1.0,
                 max_message_bytes: int | None = None, ready: Callable[[], bool] | None = None) -> None:
        self.picker = picker
        self.ready = ready
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self.max_message_bytes = max_message_bytes or picker.max_body_bytes + 65536
        self._server: Any = None
        self._life = Lifetime()

    @property
    def address(self) -> str:
        """``HOST:PORT`` it listens on."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def __aenter__(self) -> "ExtProcServer":
        import anyio
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        servicer = _Servicer(self.picker)
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(options=opts)
        servicer.grpc.add_ExternalProcessorServicer_to_server(servicer, server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

        async def report() -> None:
            ok = self.ready is None or self.ready()
            await checks.set("", serving)
            await checks.set("liveness", serving)
            for name in HEALTH_SERVICES[1:]:
                await checks.set(name, serving if ok else not_serving)

        await report()
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError:  # grpcio's "failed to bind"
            port = 0
        if port == 0:
            raise OSError(f"cannot listen for ext_proc on {self.address} (in use, or not an address of this host)")
        self.port = port
        await server.start()
        self._server = server
        self._life = life = Lifetime()
        async with life.opening():
            life.on_close(self._stop)

            async def sweep() -> None:
                while True:
                    await anyio.sleep(_SWEEP_S)
                    self.picker.sweep()
                    await report()

            await life.start(sweep, name="kvstream-extproc-sweep")
        return self

    async def _stop(self) -> None:
        if self._server is not None:
            await self._server.stop(self.grace_s)
            self._server = None

    async def __aexit__(self, *exc: object) -> None:
        await self._life.aclose()

    def metrics_text(self) -> bytes:
        """The picker's Prometheus counters."""
        v = self.picker.view()
        lines = []
        for key, help_ in (("picks", "Requests the gateway asked about that got a pick."),
                           ("refused", "Requests answered by the gateway itself (400: not an OpenAI request; "
                                       "503: no allowed engine)."),
                           ("fallbacks", "Requests the gateway's retry gave to a fallback endpoint."),
                           ("unclaimed", "Picks whose response phase never came (not counted as answered).")):
            lines += [f"# HELP kvstream_gateway_{key}_total {help_}", f"# TYPE kvstream_gateway_{key}_total counter",
                      f"kvstream_gateway_{key}_total {v[key]}"]
        lines += ["# HELP kvstream_gateway_pending Picks waiting for their response phase.",
                  "# TYPE kvstream_gateway_pending gauge", f"kvstream_gateway_pending {v['pending']}"]
        return ("\n".join(lines) + "\n").encode()
