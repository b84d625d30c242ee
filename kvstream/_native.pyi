"""Types of kvstream's native core (the Rust crate in ``rust/``, built by maturin).

Internal: the Python layers call it (``kvstream.hashing``, ``kvstream.routing``); users
call their APIs. Every entry point is a coarse call (a whole prompt, a whole batch).
"""

from array import array
from typing import Any, Iterable, Iterator, Sequence

__version__: str

class NativeLocalError(ValueError):
    """A bad call into the native core (the caller's fault)."""

class NativeRemoteError(ValueError):
    """Malformed remote input seen by the native core."""

# -- block hashing (rust/src/hash) ------------------------------------------------------

def hash_chain(
    algorithm: int,
    block_size: int,
    parent: bytes,
    tokens: list[Any] | tuple[Any, ...],
    n_blocks: int,
    extras: Sequence[Any] | None = None,
) -> list[bytes] | None:
    """Chained digests of ``n_blocks`` blocks (algorithm 0 sha256, 1 sha256_cbor, 2 xxhash,
    3 xxhash_cbor, 4 native), or None when an input needs Python's own serializer."""

# -- router keys (rust/src/keys.rs) -----------------------------------------------------

ROUTER_KEY_MASK: int

def router_chain_keys(
    raw: bytes,
    n_blocks: int,
    router_block_size: int,
    seed: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[int]:
    """Chained xxh3_64 keys of ``n_blocks`` router blocks of packed uint32-LE ids."""

def router_prompt_keys(
    tokens: list[int] | tuple[int, ...] | bytes,
    router_block_size: int,
    seed: int,
    extras: Sequence[bytes | None] | None = None,
) -> list[int] | None:
    """Keys of every full router block, or None when an id is not an exact int in [0, 2**32)."""

def router_pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes | None:
    """Ids as uint32-LE bytes, or None when an id is not an exact int in [0, 2**32)."""

# -- the residency table, ingest and query (rust/src/table.rs, ingest.rs, query.rs) ------

class NativeMap:
    """A mapping with a dict's behaviour: u64 entries in native columns, the rest in a dict."""

    def __init__(self) -> None: ...
    def get(self, key: Any, default: Any = None) -> Any: ...
    def __contains__(self, key: Any) -> bool: ...
    def __getitem__(self, key: Any) -> Any: ...
    def __setitem__(self, key: Any, value: Any) -> None: ...
    def __delitem__(self, key: Any) -> None: ...
    def pop(self, key: Any, *default: Any) -> Any: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Any]: ...
    def keys(self) -> list[Any]: ...
    def values(self) -> list[Any]: ...
    def items(self) -> list[tuple[Any, Any]]: ...
    def update(self, other: Any) -> None: ...
    def clear(self) -> None: ...
    def nbytes(self) -> int: ...
    def native_bytes(self) -> int: ...
    def shrink(self) -> None: ...
    def export_u64(self) -> tuple[array, array, dict[Any, Any]]: ...
    def load_u64(self, keys: array, values: array, other: Iterable[tuple[Any, Any]] | None = None) -> None: ...
    def get_many(self, keys: array) -> list[Any]: ...

class RawBatch:
    """A KV event payload decoded by the native reader (rust/src/decode.rs)."""

    @property
    def ts(self) -> float: ...
    @property
    def data_parallel_rank(self) -> int | None: ...
    @property
    def blocks(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes the batch holds: the object and its columns' allocations."""
    def __len__(self) -> int: ...
    def kind(self, i: int) -> int:
        """Event ``i``'s type: 0 BlockStored, 1 BlockRemoved, 2 AllBlocksCleared."""
    def describe(self, i: int) -> tuple[Any, ...]:
        """What the reader read of event ``i`` (for the tests)."""

def read_payload(payload: bytes, max_bytes: int) -> RawBatch | None:
    """Decode a payload (GIL released), or None: the payload is for the Python decoder."""

def apply_tokens(
    events: list[Any] | RawBatch, start: int, stored_cls: type, removed_cls: type, table: NativeMap,
    held: list[NativeMap], slot: int, fam: int, r: int, base_ns: int, reannounce: int,
    stores_ok: bool, copies: dict[Any, Any], href: dict[Any, int], unl: dict[Any, Any],
    waiting: dict[Any, Any], sized: dict[Any, Any], touched: set[Any] | None,
) -> tuple[int, int, int, int, int]:
    """(next event for the Python rules, blocks stored as new holdings, blocks removed,
    family conflicts, further copies of blocks the source held already)."""
def load_tier(table: NativeMap | None, held: NativeMap, hashes: Any, keys: Any, masks: Any,
              href: dict[Any, int]) -> list[int] | None: ...
def apply_engine(
    events: list[Any] | RawBatch, start: int, stored_cls: type, removed_cls: type, gpu: NativeMap,
    slot: int, b: int, reannounce: int, stores_ok: bool, copies: dict[Any, Any],
    touched: set[Any] | None,
) -> tuple[int, int, int]: ...
def walk_keys(map: NativeMap, keys: Iterable[Any], active: int) -> list[tuple[int, int]] | None: ...
def walk_tokens(map: NativeMap, tokens: Any, r: int, seed: int, active: int) -> tuple[int, list[tuple[int, int]]] | None: ...
def router_keys(tokens: Any, r: int, seed: int) -> list[int] | None: ...
def slot_ends_tokens(map: NativeMap, tokens: Any, r: int, seed: int, active: int,
                     n_slots: int) -> tuple[int, list[int]] | None: ...
def slot_ends_keys(map: NativeMap, keys: Any, active: int, n_slots: int) -> tuple[int, list[int]] | None: ...
def walk_tiers_tokens(maps: list[NativeMap], tokens: Any, r: int, seed: int,
                      active: int) -> tuple[int, list[tuple[int, int, list[int]]]] | None: ...
def walk_tiers_keys(maps: list[NativeMap], keys: Any, active: int) -> tuple[int, list[tuple[int, int, list[int]]]] | None: ...
def split_body(body: bytes, field: str, width: int) -> tuple[bytes, bytes] | None: ...

# -- a /query answer written from its walk (rust/src/answer.rs) ---------------------------

class RowLabels:
    """Per source slot, ``(instance head, rank, instance number)`` of its answer rows, or None."""

    def __init__(self, slots: list[tuple[bytes, bytes, int] | None]) -> None: ...
    def __len__(self) -> int: ...

def answer_tiers_tokens(maps: list[NativeMap], tokens: Any, r: int, seed: int, active: int, cols: list[int],
                        labels: RowLabels, pers: list[tuple[int, int]], block: int,
                        head: bytes) -> tuple[int, bytes, int] | None: ...
def answer_tiers_keys(maps: list[NativeMap], keys: Any, active: int, cols: list[int], labels: RowLabels,
                      pers: list[tuple[int, int]], block: int, head: bytes) -> tuple[int, bytes, int] | None: ...
