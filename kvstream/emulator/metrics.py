"""vLLM's request latency histograms for the emulated engine (``/metrics``), so a vLLM
dashboard works against ``kvstream engine``.

Same names, labels (``model_name``, ``engine``) and buckets as vLLM's v1 Prometheus
logger: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` (and
its older name ``vllm:time_per_output_token_seconds``), ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:request_inference_time_seconds``,
``vllm:request_prefill_time_seconds`` and ``vllm:request_decode_time_seconds``. Times are the
engine clock's (seconds); a request is observed once, when it finishes (aborted ones are not,
as in vLLM).
"""

from __future__ import annotations

from kvstream.emulator.core import Generation

__all__ = ["LatencyMetrics"]

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0)
_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0)


class LatencyMetrics:
    """The histograms of one engine (own registry); :meth:`finished` per request."""

    def __init__(self, model: str, engine: str = "0") -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model, engine)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (older name of the inter-token latency).",
                         _ITL)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", _REQUEST)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", _REQUEST)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", _REQUEST)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", _REQUEST)

    def finished(self, gen: Generation) -> None:
        """Observe a request that produced all its tokens (``gen.finished`` and not aborted)."""
        if gen.aborted or gen.finished_at < 0 or gen.first_token_at < 0:
            return
        admitted = gen.state.admitted_at if gen.state.admitted_at >= 0 else gen.submitted_at
        self.ttft.observe(gen.first_token_at - gen.submitted_at)
        self.e2e.observe(gen.finished_at - gen.submitted_at)
        self.queue.observe(max(0.0, admitted - gen.submitted_at))
        self.inference.observe(gen.finished_at - admitted)
        self.prefill.observe(max(0.0, gen.first_token_at - admitted))
        decode = gen.finished_at - gen.first_token_at
        self.decode.observe(decode)
        n = len(gen.output) - 1
        if n > 0:  # tokens arrive a step at a time: the mean gap, once per later token
            gap = decode / n
            for _ in range(n):
                self.itl.observe(gap)
                self.tpot.observe(gap)

    def render(self) -> bytes:
        """The histograms in the Prometheus text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
