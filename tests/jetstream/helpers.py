"""Reading a JetStream stream back for the tests (nats-py directly, not kvstream)."""

from __future__ import annotations

from typing import Any

import anyio


async def stream_messages(url: str, stream: str = "KV_EVENTS", subject: str = "kv.>") -> list[Any]:
    """Every message of ``stream`` on ``subject``, in stream order (an independent reader)."""
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        out = []
        seq = info.state.first_seq
        while seq <= info.state.last_seq:
            try:
                m = await js.get_msg(stream, seq=seq, subject=subject, next=True)
            except Exception:  # noqa: BLE001 - nothing further on this subject
                break
            out.append(m)
            seq = m.seq + 1
        return out
    finally:
        await nc.close()


async def collect(sub: Any, until: Any, timeout: float = 10.0) -> list[Any]:
    """Items from ``sub`` until ``until(items)`` is true; fails after ``timeout`` seconds."""
    items: list[Any] = []
    with anyio.fail_after(timeout):
        async for item in sub:
            items.append(item)
            if until(items):
                break
    return items


def batches(items: list[Any], source: str | None = None) -> list[Any]:
    """The SourceBatch items (of ``source``)."""
    from kvstream.transport import SourceBatch

    return [i for i in items if type(i) is SourceBatch and (source is None or i.source == source)]
