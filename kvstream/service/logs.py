"""Structured logs for the service: ``text`` (one readable line) or ``json`` (one JSON object
per line: ``ts``, ``level``, ``logger``, ``msg`` and any ``extra=`` fields)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec

__all__ = ["setup_logging", "JsonFormatter"]

_STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}
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


def setup_logging(fmt: str = "text", level: str = "info") -> None:
    """Send the ``kvstream`` and ``uvicorn`` loggers to stderr in ``fmt`` at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else _TextFormatter())
    lvl = getattr(logging, level.upper())
    for name in ("kvstream", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(lvl)
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True
