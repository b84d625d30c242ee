"""The data the compatibility tests need ships in the repository, unchanged: a fresh clone
runs the vLLM golden tests instead of skipping them (issue #24, item 2)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.conftest import GOLDEN, MOONCAKE_TRACE, REPO

# sha256 of each capture as recorded (the folders' READMEs list them; 0.11.0's stream.bin
# is the int-hash run).
CAPTURES = {
    "vllm-0.11.0/stream.bin": "f13818966ad944f77ccdfb6bd046930173f7b4da7aff68bbfa5cdef2b601dba0",
    "vllm-0.33.0/stream.bin": "8133008f6c91fdab9fde3d4c8303e3bcf41d97e782c571cf8a0892c3f222f029",
    "vllm-0.33.0/dp1.bin": "5ad404ea1a24e584f0c2d3f6fe53d216d94e4bf9dbe6aaa2b9452658847bd779",
    "vllm-0.33.0/stream.json": "be550598d015fc3eca7652dcca8b7de16242862558778ec6ba97eed4240d4b50",
    "vllm-0.33.0/workload.json": "4ee755aacc89e9c42188e5fbc2f2af132ce0dbd989ec9b9564753e63c91bb1cb",
}


def test_the_golden_captures_are_inside_the_repository_and_unchanged() -> None:
    assert GOLDEN == REPO / "tests" / "data" / "golden"  # nothing beside the checkout
    for name, digest in CAPTURES.items():
        assert hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() == digest, name
        assert digest in (GOLDEN / name.split("/")[0] / "README.md").read_text(encoding="utf-8"), name
    for folder in ("vllm-0.11.0", "vllm-0.33.0"):
        for f in ("README.md", "workload.json", "stream.bin", "stream.json"):
            assert (GOLDEN / folder / f).is_file(), f"{folder}/{f}"
    readme = " ".join((GOLDEN / "README.md").read_text(encoding="utf-8").split())
    assert "Apache License 2.0" in readme and "How they were recorded" in readme


def test_the_trace_ships_with_its_provenance() -> None:
    assert MOONCAKE_TRACE.is_relative_to(REPO) and MOONCAKE_TRACE.is_file()
    readme = " ".join((MOONCAKE_TRACE.parent / "README.md").read_text(encoding="utf-8").split())
    assert "kvcache-ai/Mooncake" in readme and "Apache License 2.0" in readme


def test_the_test_suite_reads_nothing_outside_the_checkout() -> None:
    """No test, conftest or bench points at ../shared any more."""
    offenders = []
    for base in ("tests", "bench"):
        for path in (REPO / base).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if path != Path(__file__) and ('"shared"' in text or "KVSTREAM_SHARED" in text or "../shared" in text):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders
