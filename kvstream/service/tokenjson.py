"""A request body's long array (token ids, hashes) read by the native core, the rest by msgspec.

A ``/query`` or ``/v1/route`` body is mostly its ``token_ids`` (4,096 ids, ~30 KB). msgspec
decodes them as 4,096 Python ints and ``array('I', ...)`` packs them again. The native core
(``kvstream._native.split_body``, ``rust/src/json.rs``) reads the array straight into
packed integers with the GIL released and hands back the other fields as a small JSON
object with the array left empty (``[]``), which msgspec decodes into the request Struct:
so every field's type, bound, unknown-field rule and error wording stays msgspec's.

:func:`decode_with_tokens` takes a body only when that decode succeeds and the emptied
array is the value of the field the caller names; anything else returns None and the
caller decodes the whole body with msgspec as before, which words the error.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, TypeVar

import msgspec

from kvstream._native import split_body

__all__ = ["decode_with_tokens"]

T = TypeVar("T")

_DECODERS: dict[Any, msgspec.json.Decoder] = {}
_LITTLE = sys.byteorder == "little" and array("I").itemsize == 4 and array("Q").itemsize == 8


def decode_with_tokens(body: bytes, type: type[T], field: str = "token_ids", width: int = 4,
                       holders: tuple[str, ...] | None = None) -> tuple[T, array, bytes] | None:
    """``body`` as a ``type`` Struct (its ``field`` left empty), that array's items
    packed (``array('I')`` for ``width`` 4, uint32 token ids; ``array('Q')`` for 8, uint64
    hashes) and the same items as little-endian bytes (what the native walks take without
    a call on the array), when the native reader takes the body, msgspec accepts the other fields and
    the emptied array is the value of one of ``holders`` (default: ``field``); None
    otherwise (decode the whole body with msgspec)."""
    if not _LITTLE:  # pragma: no cover - the packing is little-endian
        return None
    got = split_body(body, field, width)
    if got is None:
        return None
    dec = _DECODERS.get(type)
    if dec is None:
        dec = _DECODERS[type] = msgspec.json.Decoder(type)
    try:
        req: Any = dec.decode(got[0])
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None
    if not any(getattr(req, h, None) == [] for h in (holders or (field,))):
        return None  # the body's one array was another field's
    packed = array("I" if width == 4 else "Q")
    packed.frombytes(got[1])
    return req, packed, got[1]
