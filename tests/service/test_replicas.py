"""A second kvstream serve started with --peers loads a running replica's /v1/dump (the
index and each engine's last applied seq) and applies only what came after."""

from __future__ import annotations

import httpx

from kvstream.routing.index import KVIndex
from kvstream.routing.snapshot import read_snapshot
from tests.service.conftest import wait_for

BS = 16


def _state(url: str) -> dict:
    data = httpx.get(url + "/v1/dump").content
    return KVIndex.load(data).state()


def test_a_replica_starts_from_a_peers_dump_and_follows_from_there(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    a = serve(e0.arg, e1.arg, "--load-interval", "0")
    doc = list(range(4000, 4000 + 8 * BS))
    a.wait_applied("e0", e0.admit(doc, "r1"))
    seq = e1.admit(list(range(6000, 6000 + 3 * BS)), "r2")
    a.wait_applied("e1", seq)
    info = read_snapshot(httpx.get(a.url + "/v1/dump").content)
    assert info.cursors == {"e0": 0, "e1": 0}

    b = serve(e0.arg, e1.arg, "--load-interval", "0", "--peers", "http://127.0.0.1:1", a.url)
    b.wait_applied("e0", 0)
    b.wait_applied("e1", 0)
    assert {n: e["resumed_seq"] for n, e in b.engines().items()} == {"e0": 0, "e1": 0}
    # each replay socket was asked from the dumped seq (its anchor), not from 0: nothing
    # the dump held came over the wire again
    wait_for(lambda: all(e["state"] == "live" for e in b.engines().values()), "both engines live on b")
    assert {n: (e["batches"], e["last_seq"]) for n, e in b.engines().items()} == {"e0": (0, 0), "e1": (0, 0)}
    assert "loaded the index from " + a.url in b.stderr()
    # the replayed batches the dump already held were skipped, not counted twice
    assert _state(b.url) == _state(a.url)
    assert b.route(token_ids=doc)["engine"] == "e0"

    # and what comes after is applied
    more = list(range(9000, 9000 + 2 * BS))
    seq = e1.admit(more, "r3")
    b.wait_applied("e1", seq)
    r = b.route(token_ids=more)
    assert r["engine"] == "e1" and r["matched_tokens"] == 2 * BS
    wait_for(lambda: _state(b.url) == _state(a.url), "both replicas to agree")


def test_no_peer_answering_means_a_cold_start(engines, serve) -> None:
    e0 = engines("e0")
    seq = e0.admit(list(range(100, 100 + 4 * BS)), "r")
    b = serve(e0.arg, "--load-interval", "0", "--peers", "http://127.0.0.1:1")
    b.wait_applied("e0", seq)
    assert b.engines()["e0"]["resumed_seq"] is None
    assert "no peer answered" in b.stderr()
    assert b.route(token_ids=list(range(100, 100 + 4 * BS)))["matched_tokens"] == 4 * BS
