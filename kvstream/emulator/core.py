"""The emulated engine's core (sans-IO): real token ids through the simulator's engine model.

:class:`EmulatedEngine` wraps :class:`kvstream.sim.engine.EngineModel` (vLLM v1-style
scheduling on kvstream's real :class:`~kvstream.manager.KVCacheManager`: prefix caching,
chunked prefill, preemption) and gives it real requests: prompt token ids and a number of
output tokens. Time is passed in (seconds on any monotonic clock); nothing here sleeps,
reads a clock or touches a socket.

Timing model (vLLM-like, see ``docs/emulator.md``): one engine step takes
``1 / decode_tokens_per_s + prefill_tokens / prefill_tokens_per_s`` seconds, where
``prefill_tokens`` are the prompt tokens computed in that step (at most
``max_num_batched_tokens``). Tokens found in the prefix cache are not computed, so they
cost nothing: time to first token depends on where a request was routed.

Output tokens are deterministic: drawn from a generator seeded with the engine seed and
the prompt's token ids (same prompt, same output, on every engine with the same seed).
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import xxhash

from kvstream.proxy.openai import OpenAIError
from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.engine import EngineConfig, EngineModel, SimRequestState
from kvstream.sim.metrics import RunMetrics
from kvstream.sim.workload import SimRequest

__all__ = ["EmulatorConfig", "EmulatedEngine", "Generation"]


@dataclass(frozen=True)
class EmulatorConfig:
    """Shape and speed of one emulated engine (vLLM's flag names where they exist).

    Attributes:
        model: the served model name (``--served-model-name``).
        num_gpu_blocks: KV blocks in the pool, the null block included (blocks).
        block_size: tokens per KV block.
        max_model_len: longest prompt + output a request may have (tokens).
        prefill_tokens_per_s: prompt tokens computed per second.
        decode_tokens_per_s: output tokens per second per running sequence (one step
            costs ``1 / decode_tokens_per_s`` seconds plus its prefill work).
        max_num_batched_tokens: tokens one step may compute (chunked prefill budget).
        max_num_seqs: most requests running at once.
        hash_algo: vLLM's ``--prefix-caching-hash-algo`` (``sha256``, ``sha256_cbor``, ...).
        seed: output tokens are drawn from this seed and the prompt.
        default_max_tokens: output tokens when a request gives no ``max_tokens``.
        output_vocab: output token ids are drawn from ``range(*output_vocab)``.
    """

    model: str = "kvstream-emulated"
    num_gpu_blocks: int = 4096
    block_size: int = 16
    max_model_len: int = 16384
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float = 50.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    hash_algo: str = "sha256"
    seed: int = 0
    default_max_tokens: int = 16
    output_vocab: tuple[int, int] = (97, 123)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens, got {self.max_model_len}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        lo, hi = self.output_vocab
        if not 0 <= lo < hi:
            raise ValueError(f"output_vocab must be a range lo < hi of token ids, got {self.output_vocab}")
        if not (self.decode_tokens_per_s > 0 and self.prefill_tokens_per_s > 0):
            raise ValueError("prefill_tokens_per_s and decode_tokens_per_s must be > 0")
        self.engine_config()  # validates the rest (blocks, budgets)

    def engine_config(self) -> EngineConfig:
        """The simulator's :class:`EngineConfig` for these settings (stepped one by one)."""
        return EngineConfig(
            num_blocks=self.num_gpu_blocks,
            block_size=self.block_size,
            prefill_rate=self.prefill_tokens_per_s,
            decode_step_s=1.0 / self.decode_tokens_per_s,
            max_running=self.max_num_seqs,
            max_batched_tokens=self.max_num_batched_tokens,
            hash_algorithm=self.hash_algo,
            token_granularity=1,
            # Tokens are streamed one step at a time, so steps are taken one by one.
            coalesce=False,
        )


class _Prepared:
    """What :meth:`EngineModel.submit` needs of a request (see ``sim.engine.Prepared``)."""

    __slots__ = ("prompt_tokens", "output", "block_hashes", "total_tokens")

    def __init__(self, prompt: list[int], output: list[int], block_hashes: list[bytes]) -> None:
        self.prompt_tokens = prompt
        self.output = output
        self.block_hashes = block_hashes
        self.total_tokens = len(prompt) + len(output)


class Generation:
    """One request inside the engine, as its HTTP handler follows it.

    Attributes (times in the engine's clock seconds; -1.0 while unknown):
        request_id: the engine's id (str).
        prompt_tokens: prompt length (tokens).
        output: every output token id the request will produce.
        delivered: output tokens produced so far (``output[:delivered]``).
        cached_tokens: prompt tokens found in the prefix cache at admission (None until
            admitted) -- ``usage.prompt_tokens_details.cached_tokens``.
        finished: True once every token is out (or it was aborted).
        aborted: True if :meth:`EmulatedEngine.abort` dropped it.
        submitted_at, first_token_at, finished_at: times.
        preemptions: times it was preempted.
        waker: free for the async shell (it keeps its wake-up event here).
    """

    __slots__ = ("request_id", "prompt_tokens", "output", "delivered", "cached_tokens", "finished", "aborted",
                 "submitted_at", "first_token_at", "finished_at", "state", "waker")

    def __init__(self, request_id: str, prompt_tokens: int, output: list[int], state: SimRequestState,
                 now: float) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.output = output
        self.delivered = 0
        self.cached_tokens: int | None = None
        self.finished = False
        self.aborted = False
        self.submitted_at = now
        self.first_token_at = -1.0
        self.finished_at = -1.0
        self.state = state
        self.waker: Any = None

    @property
    def preemptions(self) -> int:
        """Times this request was preempted."""
        return self.state.preemptions


class EmulatedEngine:
    """The engine: :meth:`submit` requests, call :meth:`step` at :attr:`wakeup`.

    Args:
        config: an :class:`EmulatorConfig`.

    Attributes: ``config``, ``model`` (the simulator's :class:`EngineModel`; its
    ``manager`` is the real KV cache manager), ``active`` (unfinished generations),
    ``counters`` (cumulative: ``requests``, ``finished``, ``aborted``, ``prompt_tokens``,
    ``generation_tokens``, ``preemptions``).
    """

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        ec = config.engine_config()
        self._hasher = ec.block_hasher()
        self._metrics = RunMetrics(1)
        self.model = EngineModel(0, ec, SegmentHasher(self._hasher), self._metrics)
        self.active: dict[str, Generation] = {}
        self._next = 0
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "prompt_tokens": 0,
                         "generation_tokens": 0}

    # -- state, as /metrics shows it ------------------------------------------------------

    @property
    def wakeup(self) -> float:
        """When :meth:`step` is due (seconds; ``math.inf`` when idle)."""
        return self.model.wakeup

    @property
    def num_running(self) -> int:
        """Requests scheduled (prefilling or decoding)."""
        return len(self.model.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (new or preempted)."""
        return len(self.model.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use (0.0 to 1.0)."""
        return self.model.usage

    @property
    def preemptions(self) -> int:
        """Preemptions so far."""
        return self._metrics.preemptions

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (vLLM counts every admission)."""
        return self.model.manager.stats.queries

    @property
    def prefix_hits(self) -> int:
        """Prompt tokens found in the prefix cache so far."""
        return self.model.manager.stats.hits

    def output_tokens(self, prompt: Sequence[int], n: int) -> list[int]:
        """The ``n`` output token ids this engine produces for ``prompt`` (deterministic)."""
        h = xxhash.xxh64(int(self.config.seed).to_bytes(8, "little", signed=True))
        h.update(array("Q", prompt).tobytes())
        rng = random.Random(h.intdigest())
        lo, hi = self.config.output_vocab
        return [rng.randrange(lo, hi) for _ in range(n)]

    # -- requests -------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_tokens: int | None, now: float) -> Generation:
        """Queue a request arriving at ``now`` (seconds). Raises :class:`OpenAIError` 400
        (nothing queued) if it is longer than ``max_model_len`` or could never fit in the
        KV cache."""
        cfg = self.config
        n_out = cfg.default_max_tokens if max_tokens is None else max_tokens
        if type(n_out) is not int or n_out < 1:
            raise OpenAIError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
        n_in = len(prompt)
        if n_in + n_out > cfg.max_model_len:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
                f"{n_in + n_out} tokens ({n_in} in the prompt, {n_out} in the completion). Please reduce the "
                "length of the prompt or of max_tokens.", "max_tokens" if n_in < cfg.max_model_len else "prompt")
        ids = list(prompt)
        output = self.output_tokens(ids, n_out)
        hashes = self._hasher.hash_blocks(ids + output)
        rid = f"emu-{self._next}"
        req = SimRequest(self._next, now, (), 0, n_out, prompt_len=n_in)
        self._next += 1
        state = SimRequestState(req, 0, now)
        # _Prepared has every attribute submit() reads of a sim Prepared (duck-typed).
        if not self.model.submit(state, now, _Prepared(ids, output, hashes)):  # type: ignore[arg-type]
            raise OpenAIError(
                400, f"the request needs {-(-(n_in + n_out) // cfg.block_size)} KV blocks but the engine has "
                f"{cfg.num_gpu_blocks - 1}; send a shorter prompt or max_tokens", "prompt")
        gen = Generation(rid, n_in, output, state, now)
        self.active[rid] = gen
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += n_in
        return gen

    def abort(self, gen: Generation, now: float) -> None:
        """Drop an unfinished request (its client went away); frees its blocks."""
        if gen.finished:
            return
        self.model.abort(gen.state, now)
        gen.finished = gen.aborted = True
        gen.finished_at = now
        self.active.pop(gen.request_id, None)
        self.counters["aborted"] += 1

    def step(self, now: float) -> tuple[list[Any], list[Generation]]:
        """Run the step due at ``now`` (seconds). Returns the KV events it produced (one
        batch to publish) and the generations that changed (new tokens, admitted,
        finished)."""
        touched: list[Generation] = []
        # Tokens sampled by the step that ends now become visible now.
        for gen in self.active.values():
            n = gen.state.generated
            if n > gen.delivered:
                if gen.delivered == 0:
                    gen.first_token_at = now
                self.counters["generation_tokens"] += n - gen.delivered
                gen.delivered = n
                touched.append(gen)
        events = self.model.step(now)
        done: list[str] = []
        for rid, gen in self.active.items():
            st = gen.state
            if gen.cached_tokens is None and st.admitted_at >= 0 and st.kv is not None:
                gen.cached_tokens = st.kv.num_prefix_hit_tokens
            if st.finished_at >= 0:
                gen.finished = True
                gen.finished_at = now
                if gen.cached_tokens is None:
                    gen.cached_tokens = 0
                done.append(rid)
                if gen not in touched:
                    touched.append(gen)
        for rid in done:
            del self.active[rid]
            self.counters["finished"] += 1
        m = self._metrics
        if m.ttfts:  # the driver's lists are not needed here; keep them from growing
            m.ttfts.clear()
            m.queue_delays.clear()
        if self.model.wakeup < math.inf and self.model.wakeup < now:
            self.model.wakeup = now
        return events, touched
