"""Errors of the JetStream layer, on kvstream's two roots (whose fault it is)."""

from __future__ import annotations

from kvstream.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["JetStreamConfigError", "StreamMismatchError", "NatsServerError", "RemoteProtocolError"]


class JetStreamConfigError(LocalProtocolError, ValueError):
    """A bad ``nats://`` URL, stream setting or option (the caller's to fix)."""


class StreamMismatchError(LocalProtocolError):
    """The stream exists with settings that contradict the ones asked for (e.g. another
    storage type or subjects that do not cover the prefix)."""


class NatsServerError(LocalProtocolError):
    """The local nats-server could not be found or did not start."""
