"""Every input the fuzzer (``fuzz/fuzz_decoders.py``) ever found, replayed: each file in
``tests/data/fuzz/<target>/`` must pass that target's check (the native payload reader
agrees with ``EventDecoder`` and ``apply_payload`` with the Python rules; a snapshot
loads or raises ``SnapshotError``; a query body's ids are read exactly or not at all). Hand-made adversarial inputs sit beside them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fuzz_decoders", ROOT / "fuzz" / "fuzz_decoders.py")
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

CASES = sorted((ROOT / "tests" / "data" / "fuzz").glob("*/*"))


@pytest.mark.parametrize("path", CASES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_fuzzer_finding_stays_fixed(path: Path) -> None:
    harness.TARGETS[path.parent.name](path.read_bytes())


def test_the_seed_corpus_passes_every_check() -> None:
    for data in harness._seed_payloads():
        harness.check_payload(data)
    for data in harness._seed_snapshots():
        harness.check_snapshot(data)
    for data in harness._seed_bodies():
        harness.check_body(data)
