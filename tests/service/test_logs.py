"""The log setup every command shares (kvstream.service.logs)."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import pytest

from kvstream.service.logs import setup_logging


@pytest.fixture
def restore_loggers():
    names = ("kvstream", "uvicorn", "uvicorn.error")
    saved = [(logging.getLogger(n), logging.getLogger(n).handlers[:], logging.getLogger(n).level,
              logging.getLogger(n).propagate) for n in names]
    yield
    for lg, handlers, level, propagate in saved:
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def test_logs_go_to_the_current_stderr_not_a_closed_one_left_by_an_earlier_command(restore_loggers):
    # A command run in-process while stderr was redirected (a test's capture) sets up logging;
    # the redirection ends and its stream is closed; later records must not hit that stream.
    first = io.StringIO()
    with contextlib.redirect_stderr(first):
        setup_logging("json", "warning")
    first.close()
    second = io.StringIO()
    with contextlib.redirect_stderr(second):
        logging.getLogger("kvstream.test").warning("replay request ignored", extra={"waiting": 33})
    doc = json.loads(second.getvalue())
    assert doc["msg"] == "replay request ignored" and doc["waiting"] == 33 and doc["level"] == "warning"
