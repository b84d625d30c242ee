"""Every error kvstream raises on purpose, and whose fault it is.

kvstream follows h11's split. A :class:`LocalProtocolError` means the caller misused the API
(a double free, an unknown source, a bad setting): fix the calling code or the configuration;
the object refused the call and is exactly as it was. A :class:`RemoteProtocolError` means
input from outside was malformed (a peer's frame or payload, a damaged file): long-running
tasks count and log these instead of crashing, and the data that was good is kept.

Each concrete error class also derives from the builtin it always was (``ValueError`` or
``RuntimeError``), so ``except ValueError`` in existing callers keeps working. This module
imports nothing of kvstream, so every layer can use it.
"""

from __future__ import annotations

__all__ = ["KVStreamError", "LocalProtocolError", "RemoteProtocolError"]


class KVStreamError(Exception):
    """Base class of every error kvstream raises on purpose; catch it to catch them all."""


class LocalProtocolError(KVStreamError):
    """The caller misused kvstream (a bad argument, call order or configuration).

    Raised before anything changed; the message says what was wrong, the value seen and what
    to do instead."""


class RemoteProtocolError(KVStreamError):
    """Input from outside kvstream (a peer's message, a file) is malformed.

    The message says what was wrong and where (a frame, a payload path, a file offset)."""
