"""A sans-IO HTTP/1.1 response reader for the proxy's upstream connections.

Much cheaper per server-sent event than a general-purpose state machine: bytes go in with
:meth:`ResponseReader.feed`, the head comes out of :meth:`ResponseReader.head` and body
bytes out of :meth:`ResponseReader.body`, framed by ``Transfer-Encoding: chunked``,
``Content-Length`` or the end of the connection. Malformed input raises
:class:`HTTPParseError`; the head and each chunk-size line are bounded in bytes.
"""

from __future__ import annotations

from kvstream.errors import RemoteProtocolError

__all__ = ["HTTPParseError", "ResponseReader", "request_bytes"]

MAX_HEAD_BYTES = 1 << 20
_MAX_LINE = 4096
_HEX = b"0123456789abcdefABCDEF"

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


class HTTPParseError(RemoteProtocolError):
    """The engine sent something that is not an HTTP/1.1 response."""


def request_bytes(method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """One HTTP/1.1 request with ``body`` (headers must include host and content-length)."""
    lines = [f"{method} {target} HTTP/1.1".encode("ascii")]
    lines += [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class ResponseReader:
    """Reads one response after another from a connection (``no_body``: the request was
    ``HEAD``; call :meth:`reset` before the next request's response)."""

    __slots__ = ("_buf", "_state", "_left", "status", "headers", "keep_alive", "_eof", "no_body")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._eof = False
        self.no_body = False
        self.reset()

    def reset(self) -> None:
        """Start reading the next response (keeps bytes already received)."""
        self._state = _HEAD
        self._left = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = True

    @property
    def pending(self) -> int:
        """Bytes received and not read yet (after a complete response: unsolicited)."""
        return len(self._buf)

    @property
    def done(self) -> bool:
        """The whole response (head and body) has been read."""
        return self._state == _DONE

    def feed(self, data: bytes) -> None:
        """Bytes from the connection; ``b""`` means the peer closed it."""
        if data:
            self._buf += data
        else:
            self._eof = True

    def head(self) -> bool:
        """Parse the status line and headers; False until they have all arrived (1xx
        responses are skipped). :class:`HTTPParseError` for malformed input or a peer that
        closed before the head was complete."""
        while self._state == _HEAD:
            buf = self._buf
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise HTTPParseError(f"response head over {MAX_HEAD_BYTES} bytes")
                if self._eof:
                    raise HTTPParseError("connection closed before the response head was complete")
                return False
            raw = bytes(buf[:end])
            del buf[:end + 4]
            lines = raw.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
                raise HTTPParseError(f"bad status line {lines[0][:80]!r}")
            status = int(parts[1])
            headers = []
            length: int | None = None
            chunked = False
            close = parts[0] == b"HTTP/1.0"
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                    raise HTTPParseError(f"bad header line {line[:80]!r}")
                name = name.lower()
                value = value.strip(b" \t")
                headers.append((name, value))
                if name == b"content-length":
                    if not value.isdigit():
                        raise HTTPParseError(f"bad Content-Length {value[:40]!r}")
                    if length is not None and int(value) != length:
                        raise HTTPParseError("conflicting Content-Length headers")
                    length = int(value)
                elif name == b"transfer-encoding":
                    codings = [c.strip() for c in value.lower().split(b",")]
                    if codings != [b"chunked"]:
                        raise HTTPParseError(f"unsupported Transfer-Encoding {value[:40]!r}")
                    chunked = True
                elif name == b"connection":
                    tokens = [c.strip() for c in value.lower().split(b",")]
                    if b"close" in tokens:
                        close = True
                    elif b"keep-alive" in tokens and parts[0] == b"HTTP/1.0":
                        close = False
            if 100 <= status < 200:
                if status == 101:
                    raise HTTPParseError("unexpected protocol switch (101)")
                continue  # informational: the real response follows
            self.status = status
            self.headers = headers
            self.keep_alive = not close
            if self.no_body or status in (204, 304):
                self._state = _DONE
            elif chunked:
                self._state = _CHUNK_SIZE
            elif length is not None:
                self._left = length
                self._state = _LENGTH if length else _DONE
            else:
                self._state = _UNTIL_CLOSE
                self.keep_alive = False
        return True

    def body(self) -> bytes | None:
        """Body bytes available now (possibly ``b""`` at the end: check :attr:`done`), or
        None if more input is needed. :class:`HTTPParseError` for bad chunk framing or a
        peer that closed before the body was complete."""
        out: list[bytes] = []
        buf = self._buf
        while True:
            state = self._state
            if state == _DONE:
                break
            if state == _LENGTH or state == _CHUNK_DATA:
                if not buf:
                    break
                n = min(self._left, len(buf))
                out.append(bytes(buf[:n]))
                del buf[:n]
                self._left -= n
                if not self._left:
                    self._state = _DONE if state == _LENGTH else _CHUNK_CRLF
                continue
            if state == _UNTIL_CLOSE:
                if buf:
                    out.append(bytes(buf))
                    buf.clear()
                if self._eof:
                    self._state = _DONE
                break
            if state == _CHUNK_CRLF:
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise HTTPParseError("chunk data not followed by CRLF")
                del buf[:2]
                self._state = _CHUNK_SIZE
                continue
            # _CHUNK_SIZE or _TRAILERS: one line
            end = buf.find(b"\r\n")
            if end < 0:
                if len(buf) > _MAX_LINE:
                    raise HTTPParseError("chunk-size or trailer line too long")
                break
            line = bytes(buf[:end])
            del buf[:end + 2]
            if state == _TRAILERS:
                if not line:
                    self._state = _DONE
                continue
            size = line.split(b";", 1)[0].strip()
            if not size or size.strip(_HEX) or len(size) > 16:
                raise HTTPParseError(f"bad chunk size {line[:40]!r}")
            n = int(size, 16)
            if n:
                self._left = n
                self._state = _CHUNK_DATA
            else:
                self._state = _TRAILERS
        if out:
            return b"".join(out)
        if self._state == _DONE:
            return b""
        if self._eof:
            raise HTTPParseError("connection closed before the response body was complete")
        return None
