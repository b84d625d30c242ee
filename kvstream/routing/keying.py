"""How the router index keys blocks and prompts: the keying strategies of :class:`~kvstream.routing.index.KVIndex`.

One residency index, two ways to name a block:

* :class:`TokenKeys` (the default): kvstream's own router keys, chained from each stored
  block's token ids (:mod:`kvstream.routing.keys`). Any engine's blocks can be scored
  against a raw token prompt without knowing its hash algorithm or seed; blocks whose
  parent is unseen wait, unlinked, until it shows up.
* :class:`EngineHashes`: the engines' own block hashes, as their events carry them. The
  router needs a :class:`kvstream.hashing.BlockHasher` configured like the engines and hashes
  each prompt with it at query time; ingest computes nothing per block.

A strategy holds the configuration and computes a prompt's keys; the index does the rest
(residency, copies, tiers, TTL, eviction, snapshots) the same way for both.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvstream._native import router_keys
from kvstream.hashing import BlockHasher, LoRA, MMItem, RequestBlockHasher, to_external_list
from kvstream.routing._core import IndexUsageError
from kvstream.routing.keys import namespace, prompt_keys

_BASE_NS = namespace()

__all__ = ["EngineHashes", "Keying", "TokenKeys"]


class TokenKeys:
    """Key blocks by router keys computed from their tokens (:mod:`kvstream.routing.keys`).

    Args:
        router_block_size: tokens per router block (default 16); it must divide every
            engine's block size for that engine's blocks to be keyed.
    """

    __slots__ = ("block_size",)
    name = "tokens"

    def __init__(self, router_block_size: int = 16) -> None:
        if type(router_block_size) is not int or router_block_size <= 0:
            raise IndexUsageError(f"router_block_size must be a positive int (tokens), got {router_block_size!r}")
        self.block_size = router_block_size
        """Tokens per scoring block."""

    def prompt_keys(self, prompt_tokens: Sequence[int], lora: Any = None, salt: str | None = None,
                    mm_items: Sequence[Any] | None = None) -> list[int]:
        """The router keys of a prompt's full router blocks (chained by the native core when
        there is no LoRA, salt or multimodal item: ``kvstream._native.router_keys``)."""
        if lora is None and not salt and not mm_items:
            keys = router_keys(prompt_tokens, self.block_size, _BASE_NS)
            if keys is not None:
                return keys
        return prompt_keys(prompt_tokens, self.block_size, lora, salt, mm_items)

    def __repr__(self) -> str:
        return f"TokenKeys(router_block_size={self.block_size})"


class EngineHashes:
    """Key blocks by the engines' own block hashes; prompts are hashed with ``hasher``.

    Args:
        hasher: a :class:`kvstream.hashing.BlockHasher` with the engines' algorithm, seed
            (root), block size and extra-key style. Its block size is the scoring block.
        hash_form: how the engines put hashes on the wire: ``"int"`` (the low 64 bits,
            vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or ``"bytes"``.
    """

    __slots__ = ("hasher", "hash_form", "block_size", "hash_type")
    name = "engine"

    def __init__(self, hasher: BlockHasher, hash_form: str = "int") -> None:
        if not isinstance(hasher, BlockHasher):
            raise IndexUsageError(
                f"engine-hash keying needs hasher=BlockHasher(algorithm, block_size, seed=...) configured "
                f"like the engines, got {hasher!r:.80}"
            )
        if hash_form not in ("int", "bytes"):
            raise IndexUsageError(
                f"hash_form must be 'int' (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default) "
                f"or 'bytes', got {hash_form!r}"
            )
        self.hasher = hasher
        self.hash_form = hash_form
        self.block_size: int = hasher.block_size
        self.hash_type: type = int if hash_form == "int" else bytes

    def prompt_keys(self, prompt_tokens: Sequence[int], lora: Any = None, salt: str | None = None,
                    mm_items: Sequence[Any] | None = None) -> list[Any]:
        """The engines' external block hashes of the prompt's full blocks, in :attr:`hash_form`.

        ``lora``: a :class:`kvstream.hashing.LoRA` (or, for ``extra_key_style="0.11"``
        hashers, the int id); ``mm_items``: :class:`kvstream.hashing.MMItem` s or
        ``(identifier, offset, length)`` triples, sorted by offset."""
        hasher = self.hasher
        if lora is None and not mm_items and not salt:
            digests = hasher.hash_blocks(prompt_tokens)
        else:
            rh = RequestBlockHasher(hasher, lora=self._lora(lora), mm_items=_mm(mm_items),
                                    cache_salt=salt or None)
            rh.extend(prompt_tokens)
            digests = rh.block_hashes
        if self.hash_form == "bytes":
            return digests
        return to_external_list(digests)

    def _lora(self, lora: Any) -> LoRA | None:
        if lora is None or isinstance(lora, LoRA):
            return lora
        if type(lora) is int and self.hasher.extra_key_style == "0.11":
            return LoRA("", "", lora)  # 0.11 hashes the int id alone
        raise IndexUsageError(
            f"engine-hash keying needs lora=LoRA(name, path, int_id) (the engine hashes the adapter's "
            f"name and path; 0.11-style hashers also take the int id), got {lora!r}"
        )

    def __repr__(self) -> str:
        return f"EngineHashes({self.hasher!r}, hash_form={self.hash_form!r})"


Keying = TokenKeys | EngineHashes
"""A keying strategy."""


def _mm(items: Sequence[Any] | None) -> tuple[MMItem, ...]:
    if not items:
        return ()
    out = []
    for it in items:
        if isinstance(it, MMItem):
            out.append(it)
        elif isinstance(it, (tuple, list)) and len(it) == 3:
            out.append(MMItem(*it))
        else:
            raise IndexUsageError(
                f"mm_items for engine hashes are MMItem(identifier, offset, length) or "
                f"(identifier, offset, length) triples (the engine hashes the item into every "
                f"block it covers, so its length is needed), got {it!r:.80}"
            )
    return tuple(out)
