"""What a :class:`~kvstream.transport.subscriber.Subscriber` yields, per source and in order.

A consumer applies these to whatever it keeps per source (the router index, an event log):

* :class:`SourceBatch`: one decoded batch; apply it.
* :class:`SourceReset`: drop everything held for the source, then apply what follows.
* :class:`SourceStale`: the source's state is no longer exact (unrecoverable loss); keep
  applying batches but do not trust the state until a later :class:`SourceReset`.
* :class:`SourceLive`: informational; the source is caught up again.

Pure data, no behaviour; imports only the event schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kvstream.wire.events import KVEventBatch

__all__ = ["SourceBatch", "SourceReset", "SourceStale", "SourceLive", "StreamItem"]


@dataclass(slots=True)
class SourceBatch:
    """One decoded batch from ``source``: in seq order per source, never duplicated.

    ``seq`` is the publisher's sequence number; ``topic`` the topic frame (for vLLM 0.11
    replay replies, which carry none, the source's live topic); ``payload`` the raw msgpack
    bytes; ``batch`` their decoded form; ``replayed`` True when it came from a replay or a
    snapshot reply rather than the live PUB socket. Batches of a snapshot all carry
    ``seq = R - 1`` where R is the :class:`SourceReset`'s seq (the state they rebuild is
    the state after batch R - 1; -1 if the publisher had published nothing).
    """

    source: str
    seq: int
    topic: bytes
    payload: bytes
    batch: KVEventBatch
    replayed: bool


@dataclass(slots=True)
class SourceReset:
    """Drop everything held for ``source`` before applying what follows.

    ``reason``: ``"restart"`` (the publisher's seq went backwards: a new engine; ``seq`` is
    the first seq seen from it), ``"snapshot"`` (a full-state snapshot follows as
    ``SourceBatch(replayed=True)`` items; live batches resume at ``seq``), or ``"removed"``
    (the source was removed on request; ``seq`` None).
    """

    source: str
    reason: str
    seq: int | None


@dataclass(slots=True)
class SourceStale:
    """Batches ``first_missing_seq .. resume_seq - 1`` of ``source`` are lost for good
    (``reason`` says why); batches from ``resume_seq`` on follow. Mark the source's state
    stale until a later :class:`SourceReset` rebuilds it."""

    source: str
    reason: str
    first_missing_seq: int
    resume_seq: int


@dataclass(slots=True)
class SourceLive:
    """``source`` is caught up: every batch up to ``seq`` has been yielded (after joining,
    a recovery or a snapshot)."""

    source: str
    seq: int


StreamItem = Union[SourceBatch, SourceReset, SourceStale, SourceLive]
"""Any item a subscriber yields."""
