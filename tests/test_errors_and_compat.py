"""Every error says whose fault it is; every vLLM release is one object."""

from __future__ import annotations

import pytest

from kvstream import compat
from kvstream.allocator import BlockPool, BlockPoolError, KVCacheManagerError
from kvstream.errors import KVStreamError, LocalProtocolError, RemoteProtocolError
from kvstream.hashing import BlockHasher, HashingError
from kvstream.wire import BlockRemoved, EventDecodeError, EventDecoder, EventEncoder, FrameError, KVEventBatch


@pytest.mark.parametrize("cls", [BlockPoolError, KVCacheManagerError, HashingError])
def test_caller_misuse_is_a_local_protocol_error(cls: type) -> None:
    assert issubclass(cls, LocalProtocolError) and issubclass(cls, ValueError)


@pytest.mark.parametrize("cls", [EventDecodeError, FrameError])
def test_bad_peer_input_is_a_remote_protocol_error(cls: type) -> None:
    assert issubclass(cls, RemoteProtocolError) and not issubclass(cls, LocalProtocolError)


def test_one_base_catches_both_kinds() -> None:
    with pytest.raises(KVStreamError):
        EventDecoder().decode(b"\xc1garbage")
    with pytest.raises(KVStreamError):
        pool = BlockPool(num_gpu_blocks=4, block_size=16)
        pool.free_blocks([pool.null_block])


@pytest.mark.parametrize("name, expected", [("0.11", compat.VLLM_0_11), ("v0.33", compat.VLLM_0_33),
                                            ("0.33.0", compat.VLLM_0_33), ("0.11.0", compat.VLLM_0_11)])
def test_a_release_is_found_by_any_spelling(name: str, expected: compat.VllmVersion) -> None:
    assert compat.version(name) is expected


def test_an_unknown_release_names_the_known_ones() -> None:
    with pytest.raises(LocalProtocolError, match="0.11, 0.33"):
        compat.version("0.7")


def test_version_objects_build_what_the_release_does() -> None:
    v11 = compat.VLLM_0_11
    h = v11.hasher("sha256", 16, seed="x")
    assert (h.extra_key_style, h.block_size) == ("0.11", 16)
    assert BlockHasher("sha256", 16, extra_key_style="0.11", rules="0.11", seed="x").root == h.root
    pool = BlockPool(num_gpu_blocks=8, block_size=16, enable_kv_cache_events=True, **v11.pool_options())
    assert pool is not None
    batch = KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[7], medium="GPU")])
    assert v11.encoder().encode(batch) == EventEncoder("array").encode(batch)
    assert compat.VLLM_0_33.encoder().encode(batch) == EventEncoder("map").encode(batch)
