"""The service's errors: :class:`ApiError` (a client sent a bad request: a 4xx answer) and
:class:`ConfigError` (a bad flag or config file: one clear line, exit 2)."""

from __future__ import annotations

import re

import msgspec

from kvstream.errors import LocalProtocolError, RemoteProtocolError

__all__ = ["ApiError", "ConfigError", "from_msgspec"]


class ApiError(RemoteProtocolError, ValueError):
    """A request the service refuses; becomes ``{"error": {"code", "message", "where"}}``
    with HTTP ``status`` (always 4xx).

    ``code``: a stable machine-readable name (``bad_json``, ``bad_field``,
    ``unknown_engine``, ``too_large``, ...); ``where``: the offending place in the body as a
    JSON path (``$.token_ids[3]``), or None when the request as a whole is wrong.
    """

    def __init__(self, status: int, code: str, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.where = where

    def body(self) -> bytes:
        """The JSON error document."""
        return _ENC.encode({"error": {"code": self.code, "message": self.message, "where": self.where}})


class ConfigError(LocalProtocolError, ValueError):
    """A bad command-line flag or config file; the message says what, where and the fix."""


_ENC = msgspec.json.Encoder()
_AT = re.compile(r" - at `(\$[^`]*)`$")


def from_msgspec(exc: Exception) -> ApiError:
    """The :class:`ApiError` for a msgspec decode failure of a request body: 400
    ``bad_json`` for text that is not JSON (or nested deeper than msgspec decodes, a
    ``RecursionError``), 422 ``bad_field`` for JSON of the wrong shape (with the JSON path
    msgspec names)."""
    if isinstance(exc, RecursionError):  # msgspec's nesting limit: not an internal error
        return ApiError(400, "bad_json", "the body nests arrays or objects too deeply", None)
    msg = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        m = _AT.search(msg)
        where = m.group(1) if m else "$"
        text = msg[: m.start()] if m else msg
        return ApiError(422, "bad_field", f"{text} (at {where})", where)
    return ApiError(400, "bad_json", f"the body is not valid JSON: {msg}", None)
