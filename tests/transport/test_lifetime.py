"""Lifetime: contexts and close callbacks exit in reverse order after the tasks are cancelled."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import pytest

from kvstream.transport.lifetime import Lifetime


def _recorder(log: list[str]):
    @asynccontextmanager
    async def cm(name: str):
        log.append(f"enter {name}")
        try:
            yield name
        finally:
            log.append(f"exit {name}")
    return cm


def test_close_order_and_cancellation() -> None:
    log: list[str] = []
    cm = _recorder(log)

    async def main() -> None:
        started = anyio.Event()

        async def task() -> None:
            started.set()
            try:
                await anyio.sleep_forever()
            finally:
                log.append("task cancelled")

        async def callback(what: str) -> None:
            log.append(f"callback {what}")

        life = Lifetime()
        async with life.opening():
            assert await life.enter(cm("a")) == "a"
            life.on_close(callback, "x")
            await life.enter(cm("b"))
            await life.start(task, name="t")
        await started.wait()
        await life.aclose()
        await life.aclose()  # a second close does nothing

    anyio.run(main)
    assert log == ["enter a", "enter b", "task cancelled", "exit b", "callback x", "exit a"]


def test_failed_opening_closes_what_was_opened() -> None:
    log: list[str] = []
    cm = _recorder(log)

    async def main() -> None:
        life = Lifetime()
        with pytest.raises(RuntimeError, match="half way"):
            async with life.opening():
                await life.enter(cm("a"))
                raise RuntimeError("half way")
        assert log == ["enter a", "exit a"]

    anyio.run(main)


def test_close_runs_every_step_when_one_fails() -> None:
    log: list[str] = []
    cm = _recorder(log)

    async def main() -> None:
        async def broken() -> None:
            raise OSError("close failed")

        life = Lifetime()
        await life.enter(cm("a"))
        life.on_close(broken)
        with pytest.raises(OSError, match="close failed"):
            await life.aclose()

    anyio.run(main)
    assert log == ["enter a", "exit a"]
