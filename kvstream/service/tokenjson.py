"""Token ids straight from a request's JSON into a packed ``array('I')``, at C speed.

A ``/query`` or ``/v1/route`` body is mostly its ``token_ids`` (4,096 ids, ~30 KB). msgspec
decodes them as 4,096 Python ints and ``array('I', ...)`` packs them again: ~90 us of a
~200 us handler on this project's machine. simdjson (``pysimdjson``) parses the body and
hands the array over as one buffer of uint64s (~39 us), which numpy narrows to the uint32s
the router keys hash (~3 us; without numpy, two strided memoryview copies, ~20 us), with no
Python int per token.

:func:`split_token_ids` only takes bodies it can read exactly as msgspec would: one flat
JSON object (no ``{`` or ``[`` besides its own and ``token_ids``'), unique keys, scalar
values, ``token_ids`` an array of uint32s. Anything else returns None and the caller
decodes with msgspec as before, so every error answer (its status, words and JSON path)
stays msgspec's. The other fields go through ``msgspec.convert`` into the same Struct, with
the same types, bounds and unknown-field rules as a decode.
"""

from __future__ import annotations

import sys
import threading
from array import array
from typing import Any, TypeVar

import msgspec

__all__ = ["split_token_ids", "decode_with_tokens"]

T = TypeVar("T")

_LITTLE = sys.byteorder == "little" and array("I").itemsize == 4
_local = threading.local()


def _optional(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:  # pragma: no cover - depends on the environment
        return None


# pysimdjson is a dependency where it ships wheels (CPython 3.10-3.13); without it every
# body takes msgspec's route. numpy is optional (kvstream[fast]): it narrows 4,096 ids
# ~20 us faster than the memoryview route.
_simdjson: Any = _optional("simdjson")
_np: Any = _optional("numpy")


def _parser() -> Any:
    p = getattr(_local, "parser", None)
    if p is None:
        p = _local.parser = _simdjson.Parser()
    return p


def split_token_ids(body: bytes) -> tuple[dict[str, Any], array] | None:
    """``(the other fields, token_ids as array('I'))`` of a flat JSON object whose
    ``token_ids`` is an array of uint32s; None for any other body (decode it with msgspec,
    which words the error if there is one)."""
    if _simdjson is None or not _LITTLE or body[:1] != b"{":
        return None
    # Exactly one object and one array: so the array is token_ids' and holds no arrays
    # (simdjson's buffer would flatten them) and every other value is a scalar.
    first = body.find(b"[")
    if first < 0 or body.find(b"[", first + 1) >= 0 or body.find(b"{", 1) >= 0:
        return None
    parser = _parser()
    doc = arr = None
    try:
        doc = parser.parse(body)
        keys = list(doc.keys())
        if "token_ids" not in keys or len(set(keys)) != len(keys):
            return None
        fields = {k: doc[k] for k in keys if k != "token_ids"}
        arr = doc["token_ids"]
        buf = arr.as_buffer(of_type="u")
    except RuntimeError:
        _local.parser = None  # a parse result outlived its call: start a fresh parser
        return None
    except Exception:  # noqa: BLE001  any other doubt: msgspec decides and words the error
        return None
    finally:
        doc = arr = None
    packed = _narrow(buf)
    if packed is None:
        return None  # an id over 2**32 - 1: msgspec's path names which one
    return fields, packed


def _narrow(buf: Any) -> array | None:
    """uint64s (native order, little-endian host) as an ``array('I')``; None if any is over
    2**32 - 1."""
    packed = array("I")
    if _np is not None:
        a = _np.frombuffer(buf, dtype=_np.uint64)
        if a.size and int(a.max()) > 0xFFFFFFFF:
            return None
        packed.frombytes(a.astype(_np.uint32).tobytes())
        return packed
    words = memoryview(buf).cast("B").cast("I")
    high = words[1::2].tobytes()  # the high half of each uint64
    if high != bytes(len(high)):
        return None
    packed.frombytes(words[::2].tobytes())
    return packed


def decode_with_tokens(body: bytes, type: type[T]) -> tuple[T, array] | None:
    """``body`` as a ``type`` Struct (its ``token_ids`` left empty) and its token ids packed,
    when :func:`split_token_ids` takes it and the other fields are valid; None otherwise."""
    got = split_token_ids(body)
    if got is None:
        return None
    fields, packed = got
    fields["token_ids"] = []
    try:
        return msgspec.convert(fields, type), packed
    except msgspec.ValidationError:
        return None
