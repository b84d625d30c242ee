"""The status page (``GET /`` and ``/ui``) and its data (``GET /v1/status``).

The page is tested in a real browser: headless Chromium (Debian's ``chromium`` package;
``.ci/run`` installs it when missing) opens ``/`` on a ``kvstream serve --proxy``
following two ``kvstream engine`` processes, the test reads the DOM after the page's
script ran and sees both engines ``live``, then kills one engine and sees it leave
``live`` on the page (and the transition listed). Screenshots (laptop and phone widths)
are written to ``test-results/`` at the repository root for a person to look at.
Without Chromium the browser tests skip with one line naming the package (in CI, where
``CI`` is set, they fail instead: CI must run them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import warnings
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy
from kvstream.service.app import create_app
from kvstream.service.config import ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.ui import PAGE_HEADERS, StatusBoard, page

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "test-results"
DEADLINE_S = 90.0


# -- the board (sans-IO) ---------------------------------------------------------------


def test_the_board_records_each_change_once_with_its_time_and_forgets_removed_engines() -> None:
    b = StatusBoard(max_transitions=10, clock=lambda: 100.0)
    b.observe({"e0": "connecting", "e1": "connecting"}, 100.0)
    b.observe({"e0": "live", "e1": "connecting"}, 101.0)
    b.observe({"e0": "live", "e1": "connecting"}, 102.0)  # no change: nothing recorded
    b.observe({"e0": "stale"}, 105.0)  # e1 gone
    got = [(t.at, t.engine, t.from_state, t.to_state) for t in b.transitions()]
    assert got == [(105.0, "e1", "connecting", "removed"), (105.0, "e0", "live", "stale"),
                   (101.0, "e0", "connecting", "live"), (100.0, "e1", None, "connecting"),
                   (100.0, "e0", None, "connecting")]
    (span,) = b.spans(107.5)
    assert (span.name, span.state, span.since, span.for_s) == ("e0", "stale", 105.0, 2.5)


def test_the_board_keeps_only_the_last_transitions() -> None:
    b = StatusBoard(max_transitions=3)
    for i in range(10):
        b.observe({"e0": "live" if i % 2 else "recovering"}, float(i))
    assert [t.at for t in b.transitions()] == [9.0, 8.0, 7.0]
    assert b.total == 10
    with pytest.raises(ValueError, match="max_transitions"):
        StatusBoard(max_transitions=0)


def test_the_page_is_served_self_contained_and_status_answers_without_a_runtime() -> None:
    core = ServiceCore(ServeConfig([], index_max_bytes=1 << 20))
    client = TestClient(create_app(core, runtime=False).app)
    for path in ("/", "/ui"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert r.content == page()
        assert r.headers["content-security-policy"] == PAGE_HEADERS["content-security-policy"]
        assert "connect-src 'self'" in r.headers["content-security-policy"]
    # Nothing to fetch from elsewhere: no URL with a scheme, no external script or style.
    assert b"://" not in page() and b"<script src" not in page() and b"<link" not in page()
    st = client.get("/v1/status").json()
    assert st["indexes"] == [{"name": "default", "engines": 0, "blocks": 0,
                              "estimated_bytes": st["indexes"][0]["estimated_bytes"], "max_bytes": 1 << 20}]
    assert st["service"]["engines"] == 0 and st["service"]["ready"] is False and st["transitions"] == []


# -- the page in a browser -------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    msg = "headless Chromium not found: install Debian's 'chromium' package (apt-get install -y chromium)"
    if os.environ.get("CI"):
        pytest.fail(msg + "; .ci/run installs it, so CI must have it")
    warnings.warn(msg, UserWarning, stacklevel=1)  # in the warnings summary, which -q still prints
    pytest.skip(msg)


class _Rows(HTMLParser):
    """The engines' rows (``tr.engine``: name -> data-state) and the transitions
    (``li``: (engine, to-state)) of a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, str] = {}
        self.transitions: list[tuple[str, str]] = []
        self.updates = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "engine":
            self.states[a.get("data-engine") or ""] = a.get("data-state") or ""
        elif tag == "li" and "data-to" in a:
            self.transitions.append((a.get("data-engine") or "", a.get("data-to") or ""))
        elif tag == "body":
            self.updates = int(a.get("data-updates") or 0)


class _Browser:
    def __init__(self, exe: str, profile: str) -> None:
        self.exe = exe
        self.profile = profile

    def _run(self, url: str, *args: str) -> subprocess.CompletedProcess[str]:
        # virtual-time-budget: the page's script runs (its fetches included) before the dump.
        return subprocess.run([self.exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={self.profile}",
                               "--virtual-time-budget=4000", *args, url],
                              capture_output=True, text=True, timeout=120)

    def rows(self, url: str) -> _Rows:
        r = self._run(url, "--dump-dom")
        assert r.returncode == 0, r.stderr[-2000:]
        p = _Rows()
        p.feed(r.stdout)
        return p

    def screenshot(self, url: str, path: Path, size: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        r = self._run(url, f"--screenshot={path}", f"--window-size={size}", "--hide-scrollbars")
        assert r.returncode == 0 and path.stat().st_size > 1000, r.stderr[-2000:]


def _until(pred: Any, what: str, timeout: float = DEADLINE_S) -> Any:
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = pred()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture
def browser() -> Iterator[_Browser]:
    exe = _chromium()
    with tempfile.TemporaryDirectory(prefix="kvstream-chromium-") as profile:
        yield _Browser(exe, profile)


@pytest.fixture
def two_engines_and_serve(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    procs: list[Proc] = []
    try:
        e0 = start_engine("e0", log_dir=str(tmp_path), wait=False)
        procs.append(e0)
        e1 = start_engine("e1", log_dir=str(tmp_path), wait=False)
        procs.append(e1)
        e0.wait_ready(60)
        e1.wait_ready(60)
        srv = start_serve_proxy([e0, e1], extra=["--index-max-bytes", str(64 << 20), "--load-interval", "0.5",
                                                 "--replay-timeout", "0.5"], log_dir=str(tmp_path), timeout_s=60)
        procs.append(srv)
        yield e0, e1, srv
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_page_shows_both_engines_live_then_one_leaving_live_after_it_is_killed(browser, two_engines_and_serve):
    e0, e1, srv = two_engines_and_serve
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        _until(lambda: all(e["state"] == "live" for e in c.get("/v1/engines").json()["engines"]), "both engines live")
        # A few requests through the proxy, so the page has load, blocks and predicted vs realized tokens.
        for i in range(4):
            r = c.post("/v1/completions", json={"model": "kvstream-emulated", "prompt": list(range(1, 200 + 40 * i)),
                                                "max_tokens": 4})
            assert r.status_code == 200, r.text
        url = srv.url + "/"
        seen = _until(lambda: (lambda p: p if p.states == {"e0": "live", "e1": "live"} else None)(browser.rows(url)),
                      "the page to show e0 and e1 live")
        assert seen.updates >= 1
        assert ("e0", "live") in seen.transitions and ("e1", "live") in seen.transitions
        browser.screenshot(url, RESULTS / "status-page.png", "1280,800")
        browser.screenshot(url, RESULTS / "status-page-phone.png", "390,844")

        e1.kill()  # as a crash would
        gone = _until(lambda: (lambda p: p if p.states.get("e1") not in (None, "live") else None)(browser.rows(url)),
                      "the page to show e1 no longer live")
        assert gone.states["e0"] == "live"
        assert ("e1", gone.states["e1"]) in gone.transitions  # the change is listed, newest first
        browser.screenshot(url, RESULTS / "status-page-engine-down.png", "1280,800")
        # The same page at /ui.
        assert browser.rows(srv.url + "/ui").states.get("e0") == "live"
