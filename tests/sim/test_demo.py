"""``kvstream demo`` runs to completion (reduced size) over real loopback sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstream.cli import main


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_quick_demo_completes_and_replayed_index_equals_live(tmp_path: Path, transport: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    rc = main(["demo", "--quick", "--requests", "80", "--duration", "2", "--speed", "4x",
               "--engines", "3", "--transport", transport, "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "EQUAL to the live router index" in text
    assert (out / "events.kvlog").exists()
    data = json.loads((out / "results.json").read_text())
    live = data["results"][0]
    assert live["mode"] == "live" and live["completed"] == 80
    assert [r["policy"] for r in data["results"][1:]] == ["kv-aware", "kv-load", "round-robin", "least-loaded", "random"]
    assert data["meta"]["replay_equal"] is True
