"""What differs between the vLLM releases kvstream speaks, in one place.

A :class:`VllmVersion` names every setting that depends on the vLLM release an engine runs:
how the root hash is seeded, how extra keys are shaped, which event fields are filled, where
freed blocks go, the payload shape on the wire and how data-parallel ranks offset ports.
Constructors across kvstream take these settings one by one; ``VLLM_0_11.hasher(...)``,
``VLLM_0_33.pool_options()`` and friends assemble them from one object, so supporting a new
release is one new instance here (plus whatever new behaviour it brings).

This module is data only: it imports nothing of kvstream at import time (the factory
methods import their layer when called), so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvstream.hashing import BlockHasher
    from kvstream.wire import EventEncoder

__all__ = ["VllmVersion", "VLLM_0_11", "VLLM_0_33", "VERSIONS", "version"]


@dataclass(frozen=True, slots=True)
class VllmVersion:
    """The release-dependent behaviour of one vLLM version.

    Attributes:
        name: the release as users write it (``"0.11"``, ``"0.33"``).
        hash_rules: root-seed rules for :func:`kvstream.hashing.none_hash` / ``BlockHasher(rules=)``.
        extra_key_style: extra-key shape in block hashes (``BlockHasher(extra_key_style=)``).
        event_style: which ``BlockStored`` fields the pool fills (``BlockPool(event_style=)``).
        free_order: where freed unhashed blocks go (``BlockPool(free_order=)``).
        wire_format: payload shape the release's publisher writes (``EventEncoder(format)``).
        dp_offsets_port_zero: True if a data-parallel rank > 0 adds its rank to port 0 too
            (0.11 did; 0.33 keeps an ephemeral ``:0`` as it is).
        reserve_full_prompt: a new request is admitted only if its whole prompt fits
            (``KVCacheManager(reserve_full_prompt=)``; 0.33's ``scheduler_reserve_full_isl``).
    """

    name: str
    hash_rules: Literal["0.11", "0.33"]
    extra_key_style: Literal["0.11", "0.33"]
    event_style: Literal["0.11", "0.33"]
    free_order: Literal["v0.11", "v0.33"]
    wire_format: Literal["array", "map"]
    dp_offsets_port_zero: bool
    reserve_full_prompt: bool = True

    def hasher(self, algorithm: str = "sha256_cbor", block_size: int = 16, *, seed: str | None = None) -> BlockHasher:
        """A :class:`~kvstream.hashing.BlockHasher` hashing blocks as this release does."""
        from kvstream.hashing import BlockHasher

        return BlockHasher(algorithm, block_size, extra_key_style=self.extra_key_style,
                           rules=self.hash_rules, seed=seed)

    def pool_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~kvstream.allocator.BlockPool` matching this release."""
        return {"event_style": self.event_style, "free_order": self.free_order}

    def manager_options(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~kvstream.allocator.KVCacheManager` matching this release."""
        return {"reserve_full_prompt": self.reserve_full_prompt}

    def encoder(self) -> EventEncoder:
        """An :class:`~kvstream.wire.EventEncoder` writing payloads as this release's publisher does."""
        from kvstream.wire import EventEncoder

        return EventEncoder(self.wire_format)


VLLM_0_11 = VllmVersion(
    name="0.11", hash_rules="0.11", extra_key_style="0.11", event_style="0.11",
    free_order="v0.11", wire_format="array", dp_offsets_port_zero=True, reserve_full_prompt=False,
)
"""vLLM 0.11.x: array-shaped events, random root seed, untagged extra keys."""

VLLM_0_33 = VllmVersion(
    name="0.33", hash_rules="0.33", extra_key_style="0.33", event_style="0.33",
    free_order="v0.33", wire_format="map", dp_offsets_port_zero=False,
)
"""vLLM 0.26 and later (captured from 0.33.0): map-shaped events with vLLM 0.33's fields."""

VERSIONS: dict[str, VllmVersion] = {v.name: v for v in (VLLM_0_11, VLLM_0_33)}
"""Every release kvstream speaks, by name."""


def version(name: str) -> VllmVersion:
    """The :class:`VllmVersion` called ``name`` (``"0.11"``, ``"v0.33"``, ``"0.33.0"`` all work).

    Raises :class:`~kvstream.errors.LocalProtocolError` naming the known releases."""
    key = name.strip().lstrip("v")
    if key not in VERSIONS:
        key = ".".join(key.split(".")[:2])
    if key not in VERSIONS:
        from kvstream.errors import LocalProtocolError

        raise LocalProtocolError(f"unknown vLLM version {name!r}; kvstream speaks {', '.join(VERSIONS)}")
    return VERSIONS[key]
