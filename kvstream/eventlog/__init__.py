"""Event logs: a durable, crash-safe, wire-level record of a KV event stream.

* :mod:`.format`: the byte layout (sans-IO encoder and segment cursor).
* :mod:`.writer`: :class:`LogWriter` (flush policy, rotation, resume after a crash, zstd).
* :mod:`.reader`: :class:`LogReader` (segments as one stream, damage reported).
* :mod:`.summary`: :class:`LogSummary`, what ``kvstream inspect`` prints.
* :mod:`.convert`: golden ``KVSTRM01`` captures to log records.
* :mod:`.recorder` / :mod:`.replay`: recording a live subscriber, replaying onto a socket
  or into a router index (these import the transport and the router).

See ``docs/eventlog.md`` for the format, byte by byte.
"""

from __future__ import annotations

from kvstream.eventlog.format import (
    FORMAT_VERSION,
    HeaderDamagedError,
    LogControl,
    LogDamage,
    LogFormatError,
    LogMessage,
    LogRecord,
    SegmentHeader,
)
from kvstream.eventlog.reader import LogReader, read_log
from kvstream.eventlog.writer import LogWriter, zstd_available

__all__ = [
    "FORMAT_VERSION",
    "HeaderDamagedError",
    "LogControl",
    "LogDamage",
    "LogFormatError",
    "LogMessage",
    "LogReader",
    "LogRecord",
    "LogWriter",
    "SegmentHeader",
    "read_log",
    "zstd_available",
]
