"""A simulated serving engine: a sans-IO discrete-event model on kvstream's allocator.

:class:`EngineModel` owns a :class:`~kvstream.allocator.manager.KVCacheManager` and schedules like
vLLM v1's scheduler, in *virtual* time (seconds, passed in; it never reads a clock):

* Each step first serves running requests in admission order (the next prefill chunk, or
  one decode token), then admits waiting requests first-come first-served while the
  step's token budget (``max_batched_tokens``) and ``max_running`` allow. A waiting
  request that does not fit blocks the ones behind it.
* A step takes ``decode_step_s + prefill_tokens / prefill_rate`` seconds (a fixed per-step
  cost plus the prompt tokens computed in it; real tokens, see ``token_granularity``).
  The token sampled at the end of a request's last prefill chunk is its first output
  token (its TTFT); each later step samples one more.
* When a running request needs a block and none is free, the newest running request is
  preempted (freed and put back at the head of the queue, keeping its tokens) and the
  allocation retried; the request itself is preempted if it is the newest.
* Steps in which every running request only decodes within its current block and nobody
  can be admitted change nothing observable, so they are taken as one *run* of ``k``
  steps (up to just before the first step in which a request completes a block or
  finishes); an arrival cuts a run short at the next step boundary. Results (events, their
  times, metrics) equal single stepping; a test checks it.

Every transition returns the KV events the allocator produced, to be published as one
batch stamped with the transition's time.

``token_granularity`` g > 1 simulates g real tokens as one: segment lengths are divided
by g (rounded up), the block size too, and rates count real tokens; a simulated step
stands for g real steps (the first one carries the step's prefill work and produces first
tokens, the other g-1 decode), so decode time is kept. Block structure,
hashes-per-block, events and hit rates in blocks are unchanged; token ids on the wire
shrink g-fold. It exists for speed on very long traces and is documented as an
approximation (lengths rounded up to a multiple of g).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvstream.hashing import BlockHasher
from kvstream.allocator.manager import KVCacheManager, KVRequest
from kvstream.allocator.pool import BlockPool
from kvstream.sim.blocks import SegmentHasher
from kvstream.sim.metrics import RunMetrics
from kvstream.sim.workload import Segment, SimRequest, WorkloadError, segments_u16, widen_tokens

__all__ = ["EngineConfig", "EngineModel", "Prepared", "SimRequestState", "scale_segments"]


@dataclass(frozen=True)
class EngineConfig:
    """One simulated engine's shape and speed.

    Attributes:
        num_blocks: KV blocks in the pool, the null block included.
        block_size: tokens per block (real tokens; a multiple of ``token_granularity``).
        prefill_rate: prompt tokens computed per second.
        decode_step_s: seconds every step costs (the decode part of a step).
        max_running: most requests running at once (vLLM ``max_num_seqs``).
        max_batched_tokens: tokens one step may compute (chunked prefill budget).
        hash_algorithm: block hash algorithm (``native`` is fastest; any of vLLM's works).
        token_granularity: real tokens per simulated token (1 = exact).
        reserve_full_prompt: admit only if the whole prompt fits (vLLM 0.33 default).
        coalesce: take uneventful decode steps as one run (same results, much faster);
            False steps one by one (kept to check that equivalence).
    """

    num_blocks: int = 4096
    block_size: int = 16
    prefill_rate: float = 16000.0
    decode_step_s: float = 0.025
    max_running: int = 64
    max_batched_tokens: int = 8192
    hash_algorithm: str = "native"
    token_granularity: int = 1
    reserve_full_prompt: bool = True
    coalesce: bool = True

    def __post_init__(self) -> None:
        g = self.token_granularity
        if type(g) is not int or g < 1:
            raise WorkloadError(f"token_granularity must be an int >= 1 (real tokens per simulated token), got {g!r}")
        if self.block_size % g:
            raise WorkloadError(
                f"block_size {self.block_size} must be a multiple of token_granularity {g}; "
                "pick a granularity that divides the block size"
            )
        if self.num_blocks < 2:
            raise WorkloadError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if not (self.prefill_rate > 0 and self.decode_step_s > 0):
            raise WorkloadError(
                f"prefill_rate (tokens/s) and decode_step_s (s) must be > 0, got "
                f"{self.prefill_rate} and {self.decode_step_s}"
            )
        if self.max_running < 1 or self.max_batched_tokens < self.max_running:
            raise WorkloadError(
                f"need max_running >= 1 and max_batched_tokens >= max_running, got "
                f"{self.max_running} and {self.max_batched_tokens}"
            )

    @property
    def sim_block_size(self) -> int:
        """Simulated tokens per block (``block_size / token_granularity``)."""
        return self.block_size // self.token_granularity

    def block_hasher(self) -> BlockHasher:
        """The block hasher engines (and the router) use, over simulated tokens."""
        return BlockHasher(self.hash_algorithm, self.sim_block_size)


def scale_segments(segments: tuple[Segment, ...], g: int) -> tuple[Segment, ...]:
    """Segments in simulated tokens: every length divided by ``g``, rounded up."""
    if g == 1:
        return segments
    return tuple((k, -(-n // g)) for k, n in segments)


class Prepared:
    """A request as engines and the router receive it, in simulated tokens.

    Attributes:
        prompt_tokens: the prompt's token ids (``array('I')``).
        output: the output token ids the engine will generate (list).
        block_hashes: digests of every full block of prompt + output (the engine hashes a
            request once on arrival, as vLLM does; computed here so that many engines and
            runs share one computation).
        total_tokens: prompt + output length (simulated tokens).
        router_keys: the router's keys of the prompt when the router block is the engine
            block (filled in by the first run that routes with them; None before).
        engine_keys: the prompt's engine block hashes in the events' int form, for an
            engine-keyed router index (filled in on first use; None before).
    """

    __slots__ = ("prompt_tokens", "output", "block_hashes", "total_tokens", "router_keys", "engine_keys")

    def __init__(self, req: SimRequest, config: EngineConfig, hasher: SegmentHasher) -> None:
        g = config.token_granularity
        n_out = -(-req.output_len // g)
        if g == 1:
            segs = list(req.prompt)
        else:
            segs = [(k, -(-n // g)) for k, n in req.prompt]
        segs.append((req.output_key, n_out))
        # Prompt and output tokens in one pass (one join, one widening).
        toks = widen_tokens(segments_u16(segs))
        n = len(toks) - n_out
        self.prompt_tokens = toks[:n]
        self.output = toks[n:].tolist()
        self.block_hashes = hasher.hashes(segs, tokens=toks)
        self.total_tokens = len(toks)
        self.router_keys: list[int] | None = None
        self.engine_keys: list[int] | None = None


class SimRequestState:
    """A request inside the simulation (the workload request plus its progress).

    Attributes (times in simulated seconds, -1.0 while unknown): ``req``, ``engine``,
    ``kv`` (the manager's request; None before submission and once finished), ``prompt_tokens`` (simulated tokens to prefill before
    decoding, outputs appended so far included), ``output`` (all output token ids),
    ``generated`` (output tokens sampled), ``admitted_at``, ``first_token_at``,
    ``finished_at``, ``preemptions``, ``routed_at``, ``predicted_hit`` (simulated prompt
    tokens the router expected cached on this engine when it chose it; 0 if unknown).
    """

    __slots__ = ("req", "engine", "kv", "output", "generated", "admitted_at", "first_token_at",
                 "finished_at", "preemptions", "routed_at", "predicted_hit")

    def __init__(self, req: SimRequest, engine: int, routed_at: float) -> None:
        self.req = req
        self.engine = engine
        self.kv: KVRequest | None = None
        self.output: list[int] = []
        self.generated = 0
        self.admitted_at = -1.0
        self.first_token_at = -1.0
        self.finished_at = -1.0
        self.preemptions = 0
        self.routed_at = routed_at
        self.predicted_hit = 0


class EngineModel:
    """One simulated engine (sans-IO): call :meth:`submit` and :meth:`step` with times.

    Args:
        engine_id: index of this engine (metrics are per engine).
        config: its :class:`EngineConfig`.
        hasher: the shared :class:`SegmentHasher` (same block size as the config's).
        metrics: where to record what happens.

    The driver calls :meth:`step` at :attr:`wakeup` (seconds; ``math.inf`` when idle),
    publishes the events it returns, and calls :meth:`submit` for each request routed
    here. Not thread-safe; no I/O.
    """

    __slots__ = ("engine_id", "config", "hasher", "metrics", "manager", "waiting", "running",
                 "wakeup", "_g", "_bs", "_run_start", "_run_steps", "_to_free", "_blocked",
                 "usable_blocks", "rejected", "steps")

    def __init__(self, engine_id: int, config: EngineConfig, hasher: SegmentHasher, metrics: RunMetrics) -> None:
        if hasher.block_size != config.sim_block_size:
            raise WorkloadError(
                f"the segment hasher uses blocks of {hasher.block_size} simulated tokens but the "
                f"engine config needs {config.sim_block_size}; build it from config.block_hasher()"
            )
        self.engine_id = engine_id
        self.config = config
        self.hasher = hasher
        self.metrics = metrics
        pool = BlockPool(config.num_blocks, config.sim_block_size)
        self.manager = KVCacheManager(pool, hasher.hasher, reserve_full_prompt=config.reserve_full_prompt)
        self.waiting: deque[SimRequestState] = deque()
        self.running: list[SimRequestState] = []
        self.wakeup = math.inf
        self._g = config.token_granularity
        self._bs = config.sim_block_size
        self._run_start = 0.0  # start of the current decode run (seconds)
        self._run_steps = 0  # steps in the current run; 0: a single step is in flight
        self._to_free: list[SimRequestState] = []
        self._blocked = False  # the queue head could not be admitted at the last step
        self.usable_blocks = config.num_blocks - 1
        self.rejected = 0
        self.steps = 0

    # -- load, as a router sees it ------------------------------------------------------

    @property
    def num_requests(self) -> int:
        """Requests on this engine (running + waiting)."""
        return len(self.running) + len(self.waiting)

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks held (0.0 to 1.0)."""
        return self.manager.usage

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute for the requests here that have not produced a
        first token, in simulated tokens: what a proxy knows of the prefill work it sent
        here. A waiting request counts its prompt less the :attr:`SimRequestState.predicted_hit`
        the router expected (its cache lookup comes at admission), as a proxy counts it."""
        n = 0
        for st in self.waiting:
            if st.first_token_at >= 0:
                continue
            kv = st.kv
            if kv is None:
                continue
            if kv.num_computed_tokens:  # preempted after a start: what is left
                n += len(kv.token_ids) - kv.num_computed_tokens
            else:
                n += max(0, len(kv.token_ids) - st.predicted_hit)
        for st in self.running:
            if st.first_token_at >= 0:
                continue
            kv = st.kv
            if kv is None:
                continue
            n += len(kv.token_ids) - kv.num_computed_tokens
        return n

    # -- driver API ------------------------------------------------------------------------

    def submit(self, state: SimRequestState, now: float, prepared: "Prepared | None" = None) -> bool:
        """Queue a request arriving at ``now`` (seconds). Returns False, counting it as
        rejected, if it could never fit in this engine's KV cache.

        ``prepared``: the request's tokens and block hashes if the caller has them (see
        :class:`Prepared`; shared by many engines and runs); built here otherwise.
        """
        if prepared is None:
            prepared = Prepared(state.req, self.config, self.hasher)
        if -(-prepared.total_tokens // self._bs) > self.usable_blocks:
            self.rejected += 1
            return False
        state.output = prepared.output
        # new_request copies the tokens into its own list (one copy from the array).
        state.kv = self.manager.new_request(
            state.req.request_id, prepared.prompt_tokens, block_hashes=prepared.block_hashes,
        )
        self.waiting.append(state)
        if self.wakeup == math.inf:
            self.wakeup = now
        elif self._run_steps:
            # Cut the decode run at the first step boundary at or after `now`.
            d = self.config.decode_step_s * self._g
            j = max(1, math.ceil((now - self._run_start) / d - 1e-9))
            if j < self._run_steps:
                self._run_steps = j
                self.wakeup = self._run_start + j * d
        return True

    def step(self, now: float) -> list[Any]:
        """Finish the step that ends at ``now`` and start the next; returns the KV events
        of this transition (possibly empty). Sets :attr:`wakeup` to the next step's end."""
        self.steps += 1
        if self._run_steps:
            self._commit_run(self._run_steps)
            self._run_steps = 0
        if self._to_free:
            self._finish(now)
        self._schedule(now)
        return self.manager.take_events()

    def abort(self, state: SimRequestState, now: float) -> bool:
        """Drop a request that is no longer wanted (its client went away) at ``now``
        (seconds): taken out of the queue, or freed if running. Returns False if it had
        already finished (or is finishing at the end of this step)."""
        if state.kv is None or state in self._to_free:
            return False
        if state in self.running:
            self.running.remove(state)
            if state.kv.running:
                self.manager.free(state.kv)
        elif state in self.waiting:
            self.waiting.remove(state)
        else:
            return False
        state.kv = None
        state.finished_at = now
        self._blocked = False
        return True

    # -- internals ----------------------------------------------------------------------

    def _finish(self, now: float) -> None:
        m = self.metrics
        free = self.manager.free
        for st in self._to_free:
            if st.kv is not None and st.kv.running:
                free(st.kv)
            # Done with it: dropping the manager's request (its token list) leaves a
            # finished run nothing big for the cycle collector to walk afterwards.
            st.kv = None
            self.running.remove(st)
            st.finished_at = now
            m.completed += 1
            m.output_tokens += st.req.output_len
        self._to_free = []
        self._blocked = False

    def _preempt_newest(self) -> SimRequestState:
        victim = self.running.pop()
        self.manager.free(victim.kv)  # type: ignore[arg-type]
        victim.preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(victim)
        self._blocked = False
        return victim

    def _commit_run(self, j: int) -> None:
        """Apply ``j`` decode steps of the current run to every running request."""
        decode_many = self.manager.decode_many
        for st in self.running:
            g0 = st.generated
            # Output tokens g0-1 .. g0+j-2 get their slots in these steps (the one sampled
            # before the run first). The run was sized so that none of them starts or
            # completes a block: nothing to allocate or cache, it always succeeds.
            decode_many(st.kv, st.output[g0 - 1 : g0 - 1 + j])  # type: ignore[arg-type]
            st.generated = g0 + j

    def _schedule(self, now: float) -> None:
        cfg = self.config
        mgr = self.manager
        bs = self._bs
        running = self.running
        budget = cfg.max_batched_tokens
        prefill = 0
        preempted = False
        finishing: list[SimRequestState] = []
        first_tokens: list[SimRequestState] = []
        # Can this step be the start of a multi-step decode run? Only if nobody prefills,
        # nobody needs a block now and nobody can be admitted.
        run_k = 0
        if cfg.coalesce and running and (not self.waiting or self._blocked or len(running) >= cfg.max_running):
            run_k = 1 << 30
            for st in running:
                kv = st.kv
                c = kv.num_computed_tokens  # type: ignore[union-attr]
                if c < len(kv.token_ids) or c % bs == 0:  # type: ignore[union-attr]
                    run_k = 0
                    break
                # Steps until this request completes a block or finishes; that step has
                # effects (an event, a free), so the run stops just before it.
                k = min(bs - c % bs, len(st.output) - st.generated) - 1
                if k < run_k:
                    run_k = k
            if run_k < 2:
                run_k = 0
        if run_k:
            self._run_start = now
            self._run_steps = run_k
            self.wakeup = now + run_k * cfg.decode_step_s * self._g
            return

        i = 0
        while i < len(running):
            st = running[i]
            kv = st.kv
            remaining = len(kv.token_ids) - kv.num_computed_tokens  # type: ignore[union-attr]
            if remaining:
                n = min(remaining, budget)
                if n <= 0:
                    i += 1
                    continue
                while not mgr.allocate(kv, n):  # type: ignore[arg-type]
                    preempted = True
                    if self._preempt_newest() is st:
                        break
                if st not in running:
                    continue
                budget -= n
                prefill += n
                if n == remaining:
                    if st.generated == 0:
                        st.generated = 1
                        first_tokens.append(st)
                    if st.generated >= len(st.output):
                        finishing.append(st)
            else:
                if budget <= 0:
                    i += 1
                    continue
                tok = st.output[st.generated - 1]
                while not mgr.decode(kv, tok):  # type: ignore[arg-type]
                    preempted = True
                    if self._preempt_newest() is st:
                        break
                if st not in running:
                    continue
                budget -= 1
                st.generated += 1
                if st.generated >= len(st.output):
                    finishing.append(st)
            i += 1

        waiting = self.waiting
        if not preempted:
            # Admit first-come first-served; the head blocks the queue when it does not fit.
            get_hits = mgr.get_computed_blocks
            metrics = self.metrics
            while waiting and budget > 0 and len(running) < cfg.max_running:
                st = waiting[0]
                kv = st.kv
                total = len(kv.token_ids)  # type: ignore[union-attr]
                if total <= budget:
                    # Everything after the cached prefix fits this step, whatever the prefix
                    # is: let admit() find it (one prefix lookup instead of two).
                    if not mgr.admit(kv):  # type: ignore[arg-type]
                        self._blocked = True
                        break
                    n = total - kv.num_prefix_hit_tokens  # type: ignore[union-attr]
                else:
                    n = min(total - len(get_hits(kv)) * bs, budget)  # type: ignore[arg-type]
                    if not mgr.admit(kv, n):  # type: ignore[arg-type]
                        self._blocked = True
                        break
                waiting.popleft()
                running.append(st)
                if st.admitted_at < 0:
                    st.admitted_at = now
                    metrics.queue_delays.append(now - st.req.arrival)
                # Prompt tokens looked up / found, in real tokens, at every admission.
                metrics.prompt_tokens += total * self._g
                metrics.hit_tokens += kv.num_prefix_hit_tokens * self._g  # type: ignore[union-attr]
                budget -= n
                prefill += n
                if n + kv.num_prefix_hit_tokens == total:  # type: ignore[union-attr]
                    if st.generated == 0:
                        st.generated = 1
                        first_tokens.append(st)
                    if st.generated >= len(st.output):
                        finishing.append(st)
            else:
                if not waiting:
                    self._blocked = False
        if not running:
            # Nothing runs: idle until the next arrival, or, if everyone was just
            # preempted, retry admission at once (an empty pool fits any one request,
            # see submit).
            self.wakeup = now if waiting else math.inf
            return
        # A simulated step stands for g real steps (one per real token decoded): the first
        # carries the prefill work and samples the first tokens, the other g-1 decode.
        first_end = now + cfg.decode_step_s + prefill * self._g / cfg.prefill_rate
        end = first_end + (self._g - 1) * cfg.decode_step_s
        self.wakeup = end
        for st in first_tokens:
            st.first_token_at = first_end
            self.metrics.ttfts.append(first_end - st.req.arrival)
        self._to_free = finishing
        self.metrics.prefill_per_engine[self.engine_id] += prefill * self._g
