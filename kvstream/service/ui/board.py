"""The status board: each engine's state since when, and the last state transitions.

The subscriber knows each engine's state now, not since when or what it was before. The
board is a sans-IO observer of those states: :meth:`StatusBoard.observe` takes the
states as they are (and the time), records every change in a ring of at most
``max_transitions`` entries, and keeps per engine the time it entered its state. The
service calls it from a sampler (every ``interval_s``, :func:`sampling`) and before each
``GET /v1/status``, so the page never shows a state older than the call; a change that
comes and goes between two samples is not seen (the state metrics have the same limit).

Bounded: the ring holds ``max_transitions`` entries (each an engine name, bounded in
length by the APIs that add engines, two state names and a float), the spans one per
followed engine.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import AsyncIterator, Callable, Mapping

import anyio

from kvstream.service.schema import StateSpan, Transition

__all__ = ["StatusBoard", "sampling"]


class StatusBoard:
    """Engine states over time (see the module docstring).

    Args:
        max_transitions: transitions kept (the oldest are dropped).
        clock: wall-clock seconds (Unix time), for the times shown.
    """

    __slots__ = ("max_transitions", "clock", "started", "_since", "_ring", "total")

    def __init__(self, max_transitions: int = 200, *, clock: Callable[[], float] = time.time) -> None:
        if max_transitions < 1:
            raise ValueError(f"max_transitions must be >= 1, got {max_transitions}")
        self.max_transitions = max_transitions
        self.clock = clock
        self.started = clock()
        self._since: dict[str, tuple[str, float]] = {}
        self._ring: deque[Transition] = deque(maxlen=max_transitions)
        self.total = 0
        """Transitions recorded since the start (the ring keeps the last ones)."""

    def observe(self, states: Mapping[str, str], now: float | None = None) -> None:
        """Record ``states`` (engine -> state) as seen at ``now`` (Unix seconds; default:
        the clock): an engine new to the board, one whose state changed and one gone
        (``removed``) each add a transition."""
        at = self.clock() if now is None else now
        since = self._since
        for name, state in states.items():
            old = since.get(name)
            if old is None or old[0] != state:
                since[name] = (state, at)
                self._add(Transition(at, name, None if old is None else old[0], state))
        if len(since) != len(states) or any(n not in states for n in since):
            for name in [n for n in since if n not in states]:
                old_state = since.pop(name)[0]
                self._add(Transition(at, name, old_state, "removed"))

    def _add(self, t: Transition) -> None:
        self._ring.append(t)
        self.total += 1

    def spans(self, now: float | None = None) -> list[StateSpan]:
        """Each engine's state, since when and for how long (seconds), by name."""
        at = self.clock() if now is None else now
        return [StateSpan(n, s, since, round(max(0.0, at - since), 3))  # type: ignore[arg-type]
                for n, (s, since) in sorted(self._since.items())]

    def transitions(self) -> list[Transition]:
        """The transitions kept, newest first."""
        return list(reversed(self._ring))


@contextlib.asynccontextmanager
async def sampling(sample: Callable[[], None], interval_s: float = 0.25) -> AsyncIterator[None]:
    """Call ``sample()`` every ``interval_s`` seconds while the block runs (a task group
    owns the loop; leaving the block cancels it)."""

    async def loop() -> None:
        while True:
            sample()
            await anyio.sleep(interval_s)

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()
