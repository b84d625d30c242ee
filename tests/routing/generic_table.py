"""A second :class:`~kvstream.routing.table.BlockTable` for the tests: a ``bytes -> bytes``
store driven through the index's generic Python path (the oracle of the native table's
ingest: same rules, none of them native)."""

from __future__ import annotations

from array import array
from typing import Any, Iterable, Iterator

import msgspec

_MISSING: Any = object()
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class BytesStoreTable:
    """A :class:`~kvstream.routing.table.BlockTable` over a ``bytes -> bytes`` store, the
    way a remote key-value backend (Valkey, a JetStream KV bucket) would hold the block
    table: keys and values serialized with msgpack, nothing kept as Python objects. Written
    against the protocol alone: the index must drive it through its generic path."""

    def __init__(self) -> None:
        self.store: dict[bytes, bytes] = {}

    @staticmethod
    def _load(raw: bytes) -> Any:
        v = _dec.decode(raw)
        return tuple(v) if type(v) is list else v

    def get(self, key: Any, default: Any = None) -> Any:
        raw = self.store.get(_enc.encode(key))
        return default if raw is None else self._load(raw)

    def __contains__(self, key: Any) -> bool:
        return _enc.encode(key) in self.store

    def __setitem__(self, key: Any, value: Any) -> None:
        self.store[_enc.encode(key)] = _enc.encode(value)

    def __delitem__(self, key: Any) -> None:
        del self.store[_enc.encode(key)]

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        raw = self.store.pop(_enc.encode(key), None)
        if raw is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        return self._load(raw)

    def __len__(self) -> int:
        return len(self.store)

    def __iter__(self) -> Iterator[Any]:
        return map(_dec.decode, list(self.store))

    def items(self) -> Iterator[tuple[Any, Any]]:
        return ((_dec.decode(k), self._load(v)) for k, v in list(self.store.items()))

    def nbytes(self) -> int:
        return 100 * len(self.store)

    def shrink(self) -> None:
        pass

    def export_u64(self) -> tuple[array, array, dict[Any, Any]]:
        ks, vs, other = array("Q"), array("Q"), {}
        for k, v in self.items():
            if type(k) is int and 0 < k < 2**64 and type(v) is int:
                ks.append(k)
                vs.append(v)
            else:
                other[k] = v
        return ks, vs, other

    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] = ()) -> None:
        new = [*zip(keys, values), *other]
        if len({k for k, _ in new}) != len(new) or any(k in self or k == 0 for k, _ in new):
            raise ValueError("a duplicate or zero key")
        for k, v in new:
            self[k] = v
