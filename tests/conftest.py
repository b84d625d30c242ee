"""Shared fixtures: where the golden vLLM captures and the traces live.

The captures sit in ``../shared`` beside the checkout (or at ``$KVSTREAM_SHARED``). Tests
that need them skip when they are absent, unless ``KVSTREAM_REQUIRE_SHARED=1`` (set by
``.ci/run``), in which case their absence is a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("KVSTREAM_SHARED", REPO.parent / "shared"))
GOLDEN = SHARED / "golden"
TRACES = SHARED / "traces"


def _need(path: Path) -> Path:
    if not path.exists():
        if os.environ.get("KVSTREAM_REQUIRE_SHARED") == "1":
            pytest.fail(f"{path} is missing but KVSTREAM_REQUIRE_SHARED=1")
        pytest.skip(f"{path} not present (set KVSTREAM_SHARED to the shared/ folder)")
    return path


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """The folder holding ``vllm-0.11.0/`` and ``vllm-0.33.0/``."""
    return _need(GOLDEN)


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The Mooncake conversation trace (JSON lines)."""
    return _need(TRACES / "mooncake_conversation.jsonl")


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (the backend kvstream's sockets are tuned for)."""
    return "asyncio"
