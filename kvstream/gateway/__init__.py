"""kvstream as the endpoint picker of an Inference Gateway (Envoy's ext_proc protocol).

* :mod:`kvstream.gateway.picker`: the sans-IO picker over a proxy's routing (picks,
  refusals, the response phase's counting).
* :mod:`kvstream.gateway.extproc`: the ``envoy.service.ext_proc.v3.ExternalProcessor``
  gRPC server over it (grpcio's asyncio API, xds-protos' message classes).

``kvstream serve --ext-proc-port PORT`` runs it beside the HTTP API (docs/gateway.md).
"""

from kvstream.gateway.picker import EndpointPicker, Exchange, Pick, Refusal, UsageScanner, endpoint_of

__all__ = ["EndpointPicker", "Exchange", "Pick", "Refusal", "UsageScanner", "endpoint_of"]
