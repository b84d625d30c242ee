"""`kvstream simulate --plot`: the optional matplotlib plot, and its absence handled."""

from __future__ import annotations

import json
import sys

import pytest

from kvstream.cli import main

ARGS = ["simulate", "--requests", "40", "--engines", "2", "--policies", "kv-aware,round-robin", "--quiet"]


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<?xml")])
def test_plot_is_written_in_the_format_its_suffix_names(tmp_path, suffix, magic):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"plot{suffix}"
    res = tmp_path / "r.json"
    assert main([*ARGS, "--plot", str(out), "--json", str(res)]) == 0
    assert out.read_bytes().startswith(magic)
    assert {r["policy"] for r in json.loads(res.read_text())["results"]} == {"kv-aware", "round-robin"}


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    code = main([*ARGS, "--plot", str(tmp_path / "p.png")])
    assert code != 0
    assert "kvstream[plot]" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
