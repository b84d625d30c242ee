"""The simdjson route for token ids reads a body exactly as msgspec does, or declines it."""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.service.mooncake import QueryRequest
from kvstream.service.schema import RouteRequest
from kvstream.service.tokenjson import decode_with_tokens, split_token_ids


def test_a_plain_query_body_is_taken_with_its_ids_packed() -> None:
    ids = [0, 1, 119_999, 0xFFFFFFFF] * 1024
    body = json.dumps({"model": "m", "token_ids": ids, "block_size": 16, "tenant_id": "t\u00e9"}).encode()
    got = decode_with_tokens(body, QueryRequest)
    assert got is not None
    q, packed = got
    assert packed.typecode == "I" and packed == array("I", ids)
    assert (q.model, q.block_size, q.tenant_id, q.token_ids) == ("m", 16, "t\u00e9", [])


@pytest.mark.parametrize("body", [
    b'{"model":"m","token_ids":[1,[2]],"block_size":16}',  # nested: simdjson would flatten it
    b'{"model":"m","token_ids":[[1]],"block_size":16}',
    b'{"model":"m","token_ids":[4294967296],"block_size":16}',  # over uint32
    b'{"model":"m","token_ids":[-1],"block_size":16}',
    b'{"model":"m","token_ids":[1.0],"block_size":16}',
    b'{"model":"m","token_ids":[true],"block_size":16}',
    b'{"model":"m","token_ids":[1,"2"],"block_size":16}',
    b'{"model":"m","token_ids":[1,2,],"block_size":16}',  # malformed JSON
    b'{"model":"a","model":"b","token_ids":[1],"block_size":16}',  # duplicate key
    b'\xef\xbb\xbf{"model":"m","token_ids":[1],"block_size":16}',  # a BOM msgspec refuses
    b'{"model":"m","token_ids":[1],"block_size":16,"x":{"y":1}}',  # a nested object
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
    assert split_token_ids(b'{"token_ids":[1],"speculat":true}') is not None


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
        q, fast = got
        assert fast == packed
        ref.token_ids = []
        assert q == ref


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "memoryview"])
def test_both_narrowing_routes_pack_and_refuse_alike(numpy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstream.service import tokenjson

    if numpy:
        pytest.importorskip("numpy")
    else:
        monkeypatch.setattr(tokenjson, "_np", None)
    ids = [0, 7, 0xFFFFFFFF, 120_000]
    got = split_token_ids(json.dumps({"token_ids": ids}).encode())
    assert got is not None and got[1] == array("I", ids)
    assert split_token_ids(b'{"token_ids":[1,4294967296]}') is None
    assert split_token_ids(b'{"token_ids":[18446744073709551615]}') is None
    assert split_token_ids(b'{"token_ids":[]}') == ({}, array("I"))


def test_without_simdjson_every_body_takes_msgspecs_route(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstream.service import tokenjson

    monkeypatch.setattr(tokenjson, "_simdjson", None)
    assert split_token_ids(b'{"token_ids":[1,2]}') is None
