"""What an async context-managed object opens in ``__aenter__`` and must close in ``__aexit__``.

The router, the service runtime, the JetStream relay, source and snapshot writer each enter
other contexts (a subscriber, a NATS connection) and then run background tasks in one task
group. :class:`Lifetime` holds both: contexts and close callbacks in order, then the task
group; :meth:`Lifetime.aclose` cancels the tasks, waits for them, and exits everything else
in reverse order (each step runs even if an earlier one failed). If ``__aenter__`` fails half
way, :meth:`Lifetime.opening` closes what was already opened and re-raises.

    async def __aenter__(self):
        self._life = life = Lifetime()
        async with life.opening():
            await life.enter(self._sub)
            await life.start(self._pump, name="pump")
        return self

    async def __aexit__(self, *exc):
        await self._life.aclose()

As with any task group, ``__aenter__`` and ``__aexit__`` must run in the same task.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncContextManager, TypeVar

import anyio
import anyio.abc

T = TypeVar("T")


class Lifetime:
    """Contexts, close callbacks and one task group owned by an object (see the module doc)."""

    def __init__(self) -> None:
        self._stack = AsyncExitStack()
        self._tg: anyio.abc.TaskGroup | None = None

    async def enter(self, cm: AsyncContextManager[T]) -> T:
        """Enter ``cm`` now; it is exited on close, after the tasks and later contexts."""
        return await self._stack.enter_async_context(cm)

    def on_close(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Await ``fn(*args)`` on close, in reverse order with the contexts."""
        self._stack.push_async_callback(fn, *args)

    async def start(self, fn: Callable[[], Coroutine[Any, Any, Any]], *, name: str) -> None:
        """Run ``fn()`` in the background until close (the task group opens on first use)."""
        if self._tg is None:
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
        self._tg.start_soon(fn, name=name)

    @asynccontextmanager
    async def opening(self) -> AsyncIterator[Lifetime]:
        """Close everything opened so far if the block raises, then re-raise."""
        try:
            yield self
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Cancel the background tasks, wait for them, then exit the contexts in reverse."""
        tg, self._tg = self._tg, None
        if tg is not None:
            tg.cancel_scope.cancel()
        await self._stack.aclose()
