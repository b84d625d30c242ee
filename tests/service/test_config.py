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
]


@pytest.mark.parametrize("text", FORMS)
def test_engine_forms_parse_like_subscribe_and_record(text: str) -> None:
    assert parse_engine(text).source == parse_source(text)
    with_http = parse_engine(text + ",http=http://h:8000/")
    assert with_http.source == parse_source(text) and with_http.http == "http://h:8000"


@pytest.mark.parametrize("text", ["nope", "e0=tcp://h:1,bogus=1", "tcp://h:1,tcp://h:2,tcp://h:3", "=tcp://h:1",
                                  "tcp://h:1,http=x", "tcp://h:1,http=http://a,http=http://b", "tcp://h:1,name="])
def test_bad_engines_are_config_errors_like_subscribe_refuses_them(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_engine(text)
    if "http=" not in text:
        with pytest.raises(ValueError):
            parse_source(text)
