"""``kvstream serve`` end to end: real engine processes publishing their allocator's events,
the service as a subprocess, an HTTP client."""

from __future__ import annotations

import signal

import httpx

from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import wait_for

BS = 16


def _prompt(base: int, blocks: int) -> list[int]:
    return [base + i for i in range(blocks * BS)]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_the_engine_holding_the_prefix_is_chosen_and_load_shifts_the_choice(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0.2")
    doc = _prompt(1000, 8)
    seq = e1.admit(doc, "r1")
    srv.wait_applied("e1", seq)
    srv.wait_applied("e0", -1)

    r = srv.route(token_ids=doc + [7, 8, 9])
    assert r["engine"] == "e1"
    assert r["matched_tokens"] == 8 * BS
    assert [s["engine"] for s in r["scores"]] == ["e1", "e0"]
    top = r["scores"][0]
    assert top["matched_blocks"] == 8 and top["tiers"] == {"GPU": 8 * BS} and top["state"] == "live"

    # Load from the request outweighs the hit ...
    r = srv.route(token_ids=doc, loads={"e1": {"queue": 20}})
    assert r["engine"] == "e0"
    # ... and so does load scraped from the engine's own /metrics.
    assert e1.cmd(load={"running": 2, "waiting": 30, "kv": 0.9}) == {"ok": True}
    wait_for(lambda: srv.engines()["e1"]["load"]["queue"] == 30, "the scrape of e1's load")
    view = srv.engines()["e1"]["load"]
    assert view["running"] == 2 and view["kv_usage"] == 0.9 and view["stale"] is False
    assert srv.route(token_ids=doc)["engine"] == "e0"


def test_metrics_parse_and_counters_move(engines, serve) -> None:
    e0 = engines("e0")
    srv = serve(e0.arg, "--load-interval", "0")
    seq = e0.admit(_prompt(50, 4), "a")
    srv.wait_applied("e0", seq)
    before = _samples(srv.client.get("/metrics").text)
    srv.route(token_ids=_prompt(50, 4))
    srv.client.post("/v1/route", json={"token_ids": "nope"})
    after = _samples(srv.client.get("/metrics").text)
    k_ok = ("kvstream_route_requests_total", (("api", "route"), ("outcome", "ok")))
    k_rej = ("kvstream_route_requests_total", (("api", "route"), ("outcome", "rejected")))
    assert after[k_ok] == before[k_ok] + 1
    assert after[k_rej] == before[k_rej] + 1
    assert after[("kvstream_route_chosen_total", (("engine", "e0"),))] >= 1
    assert after[("kvstream_engine_events_total", (("engine", "e0"),))] >= 1
    assert after[("kvstream_engine_state", (("engine", "e0"), ("state", "live")))] == 1
    assert after[("kvstream_engine_blocks", (("engine", "e0"), ("medium", "GPU")))] == 4
    assert after[("kvstream_route_matched_tokens_count", (("api", "route"),))] >= 1
    assert after[("kvstream_index_entries", (("index", "default"),))] == 4


def test_sighup_reloads_the_engine_list_keeping_engines_that_stay(engines, serve, tmp_path) -> None:
    e0, e1 = engines("e0"), engines("e1")
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'engines = ["{e0.arg}"]\nload-interval = 0\n')
    srv = serve("--config", str(cfg))
    seq = e0.admit(_prompt(7000, 3), "a")
    srv.wait_applied("e0", seq)
    assert set(srv.engines()) == {"e0"}

    cfg.write_text(f'engines = ["{e0.arg}", "{e1.arg}"]\nload-interval = 0\n')
    srv.signal(signal.SIGHUP)
    srv.wait_applied("e1", -1)
    # e0 stayed: its blocks were not dropped and need no replay
    assert srv.engines()["e0"]["blocks"] == {"GPU": 3}
    assert srv.route(token_ids=_prompt(7000, 3))["engine"] == "e0"

    cfg.write_text(f'engines = ["{e1.arg}"]\nload-interval = 0\n')
    srv.signal(signal.SIGHUP)
    wait_for(lambda: set(srv.engines()) == {"e1"}, "e0 to be dropped")
    r = srv.route(token_ids=_prompt(7000, 3))
    assert r["engine"] == "e1" and r["matched_tokens"] == 0

    cfg.write_text('engines = ["not an endpoint"]\n')
    srv.signal(signal.SIGHUP)
    wait_for(lambda: "reload refused" in srv.stderr(), "the bad reload to be logged")
    assert set(srv.engines()) == {"e1"}
    assert srv.close() == 0


def test_speculate_makes_the_next_similar_prompt_follow_the_first(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0", "--speculate-ttl", "30")
    srv.wait_applied("e0", -1)
    srv.wait_applied("e1", -1)
    doc = _prompt(30_000, 4)
    first = srv.route(token_ids=doc, loads={"e0": {"queue": 1}}, speculate=True)
    assert first["engine"] == "e1" and first["matched_tokens"] == 0
    # no events yet, but the choice is remembered: the same prefix follows it even when
    # e1 is now a little busier
    again = srv.route(token_ids=doc + [1, 2], loads={"e1": {"running": 1}})
    assert again["engine"] == "e1" and again["matched_tokens"] == 4 * BS
    # without speculation nothing is remembered
    other = _prompt(40_000, 4)
    srv.route(token_ids=other, loads={"e0": {"queue": 1}})
    assert srv.route(token_ids=other)["matched_tokens"] == 0


def test_workers_share_the_port_and_each_follows_every_engine(engines, serve) -> None:
    e0, e1 = engines("e0"), engines("e1")
    doc = _prompt(60_000, 5)
    e1.admit(doc, "r")
    srv = serve(e0.arg, e1.arg, "--load-interval", "0", "--workers", "2")
    assert "2 workers" in srv.listening

    def all_caught_up() -> bool:
        # new connections land on either worker: ask until several in a row agree
        for _ in range(6):
            with httpx.Client(base_url=srv.url) as c:
                r = c.post("/v1/route", json={"token_ids": doc})
                if r.json()["engine"] != "e1" or r.json()["matched_tokens"] != 5 * BS:
                    return False
        return True

    wait_for(all_caught_up, "both workers to hold e1's blocks")
    assert srv.close() == 0
