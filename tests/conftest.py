"""Shared fixtures: where the golden vLLM captures and the traces live.

Everything the suite needs ships in the repository, so a fresh clone's test run needs
nothing beside it:

* ``tests/data/golden/``: the wire captures recorded from vLLM 0.11.0's and 0.33.0's own
  code (see ``tests/data/golden/README.md``);
* ``examples/traces/mooncake_conversation.jsonl.xz``: the Mooncake conversation trace
  (see ``examples/traces/README.md``).

``$KVSTREAM_GOLDEN`` may point the golden tests at another folder of captures laid out the
same way (for example new captures being checked before they are committed). A shipped
file that is missing is a failure, never a skip: a checkout without it is broken.

Every skip the suite can still make (an optional tool such as nginx that is not
installed) is listed with its reason at the end of the run (``-rfEs`` in ``addopts``: failures and errors too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("KVSTREAM_GOLDEN") or REPO / "tests" / "data" / "golden")
TRACES = REPO / "examples" / "traces"
MOONCAKE_TRACE = TRACES / "mooncake_conversation.jsonl.xz"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing; it ships with the repository (a partial checkout?)")
    return path


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """The folder holding ``vllm-0.11.0/`` and ``vllm-0.33.0/``."""
    return _need(GOLDEN)


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The Mooncake conversation trace (JSON lines, xz-compressed; the simulator reads it
    as it is)."""
    return _need(MOONCAKE_TRACE)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (the backend kvstream's sockets are tuned for)."""
    return "asyncio"
