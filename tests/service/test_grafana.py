"""``examples/grafana/kvstream.json``: a Grafana dashboard over kvstream's metric names.

Checked against a running service, not a list: a ``kvstream serve --proxy`` follows a
``kvstream engine`` process, gets a few requests of each kind (routing, Mooncake query,
proxied completions, a refused one), and every metric the dashboard's queries name must
be in its ``/metrics`` with samples, carrying every label the queries select or group by
(``instance`` is Prometheus' own)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "kvstream.json"
BS = 16
_METRIC = re.compile(r"\b(kvstream_[a-z0-9_]+)\s*(\{[^}]*\})?")
_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_PROMETHEUS_OWN = {"instance", "job"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict) -> list[str]:
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append(t["expr"])
    return out


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    d = _dashboard()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for what in ("engine state", "lag", "latency", "hit rate", "predicted vs realized", "index memory"):
        assert what in titles, what


@pytest.fixture
def proxy_serve(tmp_path: Path) -> Iterator[Proc]:
    procs: list[Proc] = []
    try:
        e0 = start_engine("e0", log_dir=str(tmp_path), timeout_s=60)
        procs.append(e0)
        srv = start_serve_proxy([e0], extra=["--load-interval", "0.5"], log_dir=str(tmp_path), timeout_s=60)
        procs.append(srv)
        yield srv
    finally:
        for p in reversed(procs):
            p.stop()


def _samples(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def test_every_metric_the_dashboard_queries_is_exported_by_a_running_serve(proxy_serve: Proc) -> None:
    prompt = list(range(1, 1 + 8 * BS))
    with httpx.Client(base_url=proxy_serve.url, timeout=30) as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"model": "kvstream-emulated", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert c.post("/v1/route", json={"token_ids": prompt}).status_code == 200
        assert c.post("/query", json={"model": "default", "token_ids": prompt, "block_size": BS}).status_code == 200
        assert c.post("/v1/route", json={"token_ids": "nope"}).status_code == 422
        exported = _samples(c.get("/metrics").text)

    missing = []
    for expr in _exprs(_dashboard()):
        grouped = {x.strip() for m in _BY.finditer(expr) for x in m.group(1).split(",") if x.strip()}
        for m in _METRIC.finditer(expr):
            name, selector = m.group(1), m.group(2) or ""
            if name not in exported:
                missing.append(f"{name} (in {expr!r})")
                continue
            labels = {lm.group(1) for lm in _LABEL.finditer(selector)} - _PROMETHEUS_OWN
            if not labels <= exported[name]:
                missing.append(f"{name} has no label(s) {sorted(labels - exported[name])}")
        used = {m.group(1) for m in _METRIC.finditer(expr)}
        have = set().union(*(exported.get(n, set()) for n in used)) | {"le"}
        if not (grouped - _PROMETHEUS_OWN) <= have:
            missing.append(f"grouped by {sorted(grouped - have)} that no metric of {expr!r} carries")
    assert not missing, "\n".join(missing)
