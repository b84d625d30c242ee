"""The ENGINE syntax is the subscribe/record syntax plus http=URL."""

from __future__ import annotations

import pytest

from kvstream.cli._endpoints import parse_source
from kvstream.service.config import parse_engine
from kvstream.service.errors import ConfigError

FORMS = [
    "tcp://h:5557",
    "e0=tcp://h:5557",
    "e0=tcp://h:5557,tcp://h:5558",
    "tcp://h:5557,replay=tcp://h:5558,name=e1",
    "ipc:///tmp/x.sock,ipc:///tmp/y.sock",
    "e2=tcp://h:5557,name=e3",
    "e4=tcp://h:5557,tcp://h:5558,forwarded=yes",
    "tcp://h:5557,forwarded=no",
]


@pytest.mark.parametrize("text", FORMS)
def test_engine_forms_parse_like_subscribe_and_record(text: str) -> None:
    assert parse_engine(text).source == parse_source(text)
    with_http = parse_engine(text + ",http=http://h:8000/")
    assert with_http.source == parse_source(text) and with_http.http == "http://h:8000"


def test_forwarded_yes_turns_on_the_forwarder_probe_for_that_engine_only() -> None:
    # A source behind a forwarder needs SourceSpec(forwarded=True) (docs/stream.md); the
    # endpoint option is how serve, subscribe and record users set it.
    assert parse_engine("e0=tcp://h:5557,tcp://h:5558,forwarded=yes").source.forwarded is True
    assert parse_source("tcp://h:5557,forwarded=TRUE").forwarded is True
    assert parse_engine("e0=tcp://h:5557").source.forwarded is False
    assert parse_source("tcp://h:5557,forwarded=0").forwarded is False


@pytest.mark.parametrize("text", ["nope", "e0=tcp://h:1,bogus=1", "tcp://h:1,tcp://h:2,tcp://h:3", "=tcp://h:1",
                                  "tcp://h:1,http=x", "tcp://h:1,http=http://a,http=http://b", "tcp://h:1,name=",
                                  "tcp://h:1,forwarded=maybe", "tcp://h:1,forwarded="])
def test_bad_engines_are_config_errors_like_subscribe_refuses_them(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_engine(text)
    if "http=" not in text:
        with pytest.raises(ValueError):
            parse_source(text)


def test_index_table_from_flag_and_file(tmp_path) -> None:
    """`--index-table` / `index-table` name the block table of every index serve builds
    (both names are the native table now; a bad name is still an error)."""
    from kvstream.routing.table import NativeBlockTable
    from kvstream.service.config import build_config
    from kvstream.service.core import ServiceCore

    default = ServiceCore(build_config({}, ["e0=tcp://127.0.0.1:1"], None))
    assert type(default.new_index(16).table) is NativeBlockTable
    f = tmp_path / "serve.toml"
    f.write_text('index-table = "compact"\n')
    cfg = build_config({}, ["e0=tcp://127.0.0.1:1"], str(f))
    assert type(ServiceCore(cfg).new_index(16).table) is NativeBlockTable
    f.write_text('index-table = "btree"\n')
    with pytest.raises(ConfigError, match="index-table"):
        build_config({}, ["e0=tcp://127.0.0.1:1"], str(f))
