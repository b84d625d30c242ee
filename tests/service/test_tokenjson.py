"""The native route for token ids (``kvstream._native.split_body`` + msgspec on the rest) reads a
body exactly as msgspec does, or declines it."""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.service.mooncake import QueryRequest
from kvstream.service.schema import RouteRequest
from kvstream.service.tokenjson import decode_with_tokens


def test_a_plain_query_body_is_taken_with_its_ids_packed() -> None:
    ids = [0, 1, 119_999, 0xFFFFFFFF] * 1024
    body = json.dumps({"model": "m", "token_ids": ids, "block_size": 16, "tenant_id": "t\u00e9"}).encode()
    got = decode_with_tokens(body, QueryRequest)
    assert got is not None
    q, packed, raw = got
    assert packed.typecode == "I" and packed == array("I", ids) and raw == packed.tobytes()
    assert (q.model, q.block_size, q.tenant_id, q.token_ids) == ("m", 16, "t\u00e9", [])


@pytest.mark.parametrize("body", [
    b'{"model":"m","token_ids":[1,[2]],"block_size":16}',  # nested
    b'{"model":"m","token_ids":[[1]],"block_size":16}',
    b'{"model":"m","token_ids":[4294967296],"block_size":16}',  # over uint32
    b'{"model":"m","token_ids":[-1],"block_size":16}',
    b'{"model":"m","token_ids":[1.0],"block_size":16}',
    b'{"model":"m","token_ids":[true],"block_size":16}',
    b'{"model":"m","token_ids":[1,"2"],"block_size":16}',
    b'{"model":"m","token_ids":[1,2,],"block_size":16}',  # malformed JSON
    b'{"model":"m","token_ids":[1],"token_ids":[2],"block_size":16}',  # the array twice
    b'{"model":"m","x":[1],"block_size":16}',  # the one array is not token_ids'
    b'{"model":"m","token_ids":[01],"block_size":16}',  # not a JSON number
    b'\xef\xbb\xbf{"model":"m","token_ids":[1],"block_size":16}',  # a BOM msgspec refuses
    b'{"model":"[","token_ids":"x","block_size":16}',
    b'{"model":"m","token_ids":null,"block_size":16}',
    b'{"model":"m","block_size":16}',
    b'{"model":"m","token_ids":[1],"block_size":"16"}',  # a bad field: msgspec words it
    b'[1, 2]',
])
def test_anything_unusual_is_left_to_msgspec(body: bytes) -> None:
    assert decode_with_tokens(body, QueryRequest) is None


def test_unknown_fields_are_refused_where_the_struct_forbids_them() -> None:
    assert decode_with_tokens(b'{"token_ids":[1],"speculate":true}', RouteRequest) is not None
    assert decode_with_tokens(b'{"token_ids":[1],"speculat":true}', RouteRequest) is None



def test_hashes_are_packed_as_uint64_from_whichever_field_holds_them() -> None:
    from kvstream.service.mooncake import QueryByHashRequest

    got = decode_with_tokens(b'{"model":"m","block_size":16,"block_hash":[1,18446744073709551615]}',
                             QueryByHashRequest, "seq_hashes", 8, ("seq_hashes", "block_hash"))
    assert got is not None and got[1].typecode == "Q" and got[1].tolist() == [1, 2**64 - 1]
    assert got[0].block_hash == [] and got[0].seq_hashes is None


def test_a_nested_field_takes_the_serde_route_and_still_packs() -> None:
    body = b'{"model":"m","token_ids":[3,4],"block_size":16,"x":{"y":[1]}}'
    got = decode_with_tokens(body, QueryRequest)
    assert got is not None and got[1] == array("I", [3, 4])


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                    st.text(max_size=8))
_ids = st.lists(st.one_of(st.integers(-5, 2**33), st.integers(0, 2**32 - 1), st.floats(allow_nan=False),
                          st.booleans(), st.lists(st.integers(0, 9), max_size=2)), max_size=20)


@settings(max_examples=300, deadline=None)
@given(ids=_ids, extra=st.dictionaries(st.sampled_from(["model", "block_size", "tenant_id", "lora_name",
                                                         "lora_id", "cache_salt", "zz"]),
                                       st.one_of(_scalar, st.integers(1, 64), st.text(min_size=1, max_size=8)),
                                       max_size=5))
def test_taken_bodies_decode_as_msgspec_decodes_them(ids: list, extra: dict) -> None:
    body = json.dumps({**extra, "token_ids": ids}).encode()
    got = decode_with_tokens(body, QueryRequest)
    try:
        ref = msgspec.json.decode(body, type=QueryRequest)
        packed = array("I", ref.token_ids)
    except (msgspec.DecodeError, OverflowError):  # ValidationError is a DecodeError
        assert got is None
        return
    if got is not None:
        q, fast, raw = got
        assert fast == packed and raw == packed.tobytes()
        ref.token_ids = []
        assert q == ref
