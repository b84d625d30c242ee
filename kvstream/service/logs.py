"""Structured logs for the service: ``text`` (one readable line) or ``json`` (one JSON object
per line: ``ts``, ``level``, ``logger``, ``msg`` and any ``extra=`` fields), and the proxy's
access log (:func:`access_logger`: one JSON object per proxied request).

uvicorn passes ``color_message`` (the message with ANSI colour codes) as an ``extra=`` field
for its own coloured formatter; it is the same message again, so it is never written."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable

import msgspec

__all__ = ["setup_logging", "JsonFormatter", "access_logger"]

_STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName",
                                                                          "color_message"}
_ENC = msgspec.json.Encoder(enc_hook=repr)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; fields passed with ``extra=`` are kept."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                doc[k] = v
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return _ENC.encode(doc).decode("utf-8", "replace")


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s%(extras)s")
        self.converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD and not k.startswith("_") and k != "extras"}
        record.extras = "".join(f" {k}={v}" for k, v in extras.items())
        return super().format(record)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not the one it was
    created with: a command run in-process with stderr redirected (tests, embedding) must
    not leave a handler writing to a closed stream behind it."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return str(record.msg)


def access_logger(target: str) -> Callable[[dict[str, Any]], None]:
    """A writer of access-log records (dicts of JSON values), one JSON object per line, to
    ``target``: ``"-"`` for stdout, else a file path (appended to; the file is opened here,
    so a path that cannot be written raises ``OSError`` at start-up)."""
    handler: logging.Handler
    if target == "-":
        handler = logging.StreamHandler(sys.stdout)
    else:
        handler = logging.FileHandler(target, mode="a", encoding="utf-8")
    handler.setFormatter(_LineFormatter())
    lg = logging.getLogger("kvstream.access")
    lg.handlers[:] = [handler]
    lg.setLevel(logging.INFO)
    lg.propagate = False
    lg.disabled = False
    enc = _ENC.encode
    info = lg.info

    def write(record: dict[str, Any]) -> None:
        info(enc(record).decode())

    return write


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    """Send the ``kvstream`` and ``uvicorn`` loggers to stderr in ``fmt`` at ``level``."""
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter())
    lvl = getattr(logging, level.upper())
    for name in ("kvstream", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(lvl)
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True
