"""A multi-turn chat load generator over HTTP (OpenAI completions API, token-id prompts).

Each *session* is a conversation: a system prompt shared with other sessions, a document
of its own, then ``turns`` user messages; every turn's prompt is the whole history so far
(system prompt, document, earlier user messages and the engine's actual earlier answers,
taken from ``return_token_ids``), as a chat client sends it. Sessions start spread over
``start_spread_s`` seconds and think between turns. The plan is drawn from ``seed``, so two
runs send the same token sequences (the emulated engines' outputs are deterministic too).

Every turn is streamed; the client measures time to first token (from sending the request
to the first chunk with text) and reads ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import anyio
import msgspec

__all__ = ["ChatWorkload", "PhaseResult", "TurnResult", "percentile", "run_workload"]


@dataclass(frozen=True)
class ChatWorkload:
    """The conversation mix (token counts in tokens, times in seconds)."""

    sessions: int = 32
    turns: int = 4
    system_prompts: int = 4
    system_tokens: int = 600
    document_tokens: tuple[int, int] = (600, 1400)
    user_tokens: tuple[int, int] = (40, 120)
    max_tokens: tuple[int, int] = (12, 24)
    start_spread_s: float = 6.0
    think_s: tuple[float, float] = (0.2, 0.8)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("sessions, turns and system_prompts must be >= 1")

    @property
    def requests(self) -> int:
        """Requests the workload sends (sessions x turns)."""
        return self.sessions * self.turns


@dataclass
class TurnResult:
    """One request: ``ok`` (answered 200 and streamed to the end), ``ttft_s``,
    ``prompt_tokens``, ``cached_tokens`` (as the engine reported), ``engine`` (the proxy's
    ``x-kvstream-engine``), ``error`` (why it failed)."""

    session: int
    turn: int
    ok: bool = False
    ttft_s: float = -1.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: str | None = None
    error: str | None = None


@dataclass
class PhaseResult:
    """Every turn of one run, and its wall time (seconds)."""

    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[TurnResult]:
        """The turns that succeeded."""
        return [t for t in self.turns if t.ok]

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over the successful turns."""
        ok = self.ok
        total = sum(t.prompt_tokens for t in ok)
        return sum(t.cached_tokens for t in ok) / total if total else 0.0

    def ttft(self, q: float) -> float:
        """The ``q`` quantile (0..1) of time to first token, seconds (nan if none)."""
        return percentile([t.ttft_s for t in self.ok], q)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank quantile ``q`` (0..1) of ``values``; nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class _Plan:
    __slots__ = ("start", "system", "document", "users", "max_tokens", "think")

    def __init__(self, w: ChatWorkload, rng: random.Random, systems: list[list[int]]) -> None:
        self.start = rng.uniform(0, w.start_spread_s)
        self.system = systems[rng.randrange(len(systems))]
        self.document = [rng.randrange(1000, 30000) for _ in range(rng.randint(*w.document_tokens))]
        self.users = [[rng.randrange(1000, 30000) for _ in range(rng.randint(*w.user_tokens))]
                      for _ in range(w.turns)]
        self.max_tokens = [rng.randint(*w.max_tokens) for _ in range(w.turns)]
        self.think = [rng.uniform(*w.think_s) for _ in range(w.turns)]


_dec = msgspec.json.Decoder()


async def run_workload(base_url: str, workload: ChatWorkload, *, model: str | None = None,
                       on_turn: Callable[[TurnResult], None] | None = None,
                       request_timeout_s: float = 60.0) -> PhaseResult:
    """Send ``workload`` to ``base_url`` (an OpenAI-compatible server) and measure it.
    ``on_turn`` is called after every request. Returns when every session is done."""
    import httpx

    rng = random.Random(workload.seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(workload.system_tokens)]
               for _ in range(workload.system_prompts)]
    plans = [_Plan(workload, rng, systems) for _ in range(workload.sessions)]
    result = PhaseResult()
    t0 = time.perf_counter()

    async def session(i: int, plan: _Plan, client: httpx.AsyncClient) -> None:
        await anyio.sleep(max(0.0, plan.start - (time.perf_counter() - t0)))
        history = plan.system + plan.document
        for turn in range(workload.turns):
            prompt = history + plan.users[turn]
            res = TurnResult(i, turn)
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": plan.max_tokens[turn], "stream": True,
                                    "stream_options": {"include_usage": True}, "return_token_ids": True}
            if model is not None:
                body["model"] = model
            out: list[int] = []
            sent = time.perf_counter()
            try:
                async with client.stream("POST", "/v1/completions", json=body,
                                         timeout=request_timeout_s) as r:
                    res.engine = r.headers.get("x-kvstream-engine")
                    if r.status_code != 200:
                        res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = _dec.decode(line[6:])
                            choices = chunk.get("choices") or []
                            if choices:
                                if res.ttft_s < 0:
                                    res.ttft_s = time.perf_counter() - sent
                                out += choices[0].get("token_ids") or []
                            usage = chunk.get("usage")
                            if usage:
                                res.prompt_tokens = int(usage.get("prompt_tokens", 0))
                                details = usage.get("prompt_tokens_details") or {}
                                res.cached_tokens = int(details.get("cached_tokens") or 0)
                        res.ok = res.ttft_s >= 0 and res.prompt_tokens > 0
                        if not res.ok:
                            res.error = "the stream ended without tokens or usage"
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                res.error = f"{type(exc).__name__}: {exc}"[:200]
            result.turns.append(res)
            if on_turn is not None:
                on_turn(res)
            if not res.ok:
                return  # the conversation cannot go on without the answer
            history = prompt + out
            await anyio.sleep(plan.think[turn])

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=workload.sessions)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
        async with anyio.create_task_group() as tg:
            for i, plan in enumerate(plans):
                tg.start_soon(session, i, plan, client)
    result.wall_s = time.perf_counter() - t0
    return result
