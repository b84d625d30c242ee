"""The virtual-time simulator: determinism, policies, the Mooncake comparison, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstream.cli import main
from kvstream.sim.engine import EngineConfig
from kvstream.sim.policies import POLICY_NAMES
from kvstream.sim.run import SimConfig, compare, simulate
from kvstream.sim.workload import SyntheticConfig, WorkloadError, load_mooncake, synthetic_workload

SMALL = SimConfig(engines=3, engine=EngineConfig(num_blocks=600, block_size=16, max_running=16), seed=7)


def _workload(seed: int = 1):
    return synthetic_workload(SyntheticConfig(requests=250, duration=5.0, seed=seed))


def test_same_seed_gives_identical_results() -> None:
    reqs = _workload()
    a = compare(reqs, POLICY_NAMES, SMALL)
    b = compare(_workload(), POLICY_NAMES, SMALL)
    assert [r.deterministic() for r in a] == [r.deterministic() for r in b]


def test_random_policy_depends_on_the_seed() -> None:
    reqs = _workload()
    r1 = simulate(reqs, "random", SMALL)
    r2 = simulate(reqs, "random", SimConfig(engines=3, engine=SMALL.engine, seed=8))
    assert r1.requests_per_engine != r2.requests_per_engine


def test_every_request_completes_and_round_robin_spreads_evenly() -> None:
    reqs = _workload()
    r = simulate(reqs, "round-robin", SMALL)
    assert r.completed == r.requests == 250
    assert max(r.requests_per_engine) - min(r.requests_per_engine) <= 1
    assert r.events > 0 and r.event_batches > 0
    assert 0 < r.hit_rate < 1


def test_kv_aware_beats_round_robin_on_shared_prefixes() -> None:
    reqs = _workload()
    kv = simulate(reqs, "kv-aware", SMALL)
    rr = simulate(reqs, "round-robin", SMALL)
    assert kv.hit_rate > rr.hit_rate
    assert kv.prefill_tokens < rr.prefill_tokens


def test_router_lag_delays_index_updates() -> None:
    reqs = _workload()
    lagged = simulate(reqs, "kv-aware", SimConfig(engines=3, engine=SMALL.engine, router_lag_s=0.5))
    assert lagged.router_lag_p99_s == pytest.approx(0.5)
    assert lagged.completed == 250


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(WorkloadError, match="unknown policy"):
        simulate(_workload(), "fastest", SMALL)


def test_mooncake_8_engines_kv_aware_hit_rate_beats_round_robin(mooncake_trace: Path) -> None:
    # A prefix of the trace keeps CI fast; docs/simulator.md has the full-trace numbers.
    reqs = load_mooncake(mooncake_trace, limit=2500)
    cfg = SimConfig(engines=8, engine=EngineConfig(num_blocks=1024, block_size=512, token_granularity=32))
    kv, rr = compare(reqs, ["kv-aware", "round-robin"], cfg)
    assert kv.completed == rr.completed == 2500
    assert kv.hit_rate > rr.hit_rate + 0.05


def test_simulate_cli_writes_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["simulate", "--requests", "120", "--duration", "3", "--engines", "2,3",
               "--policies", "kv-aware,round-robin", "--json", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "kv-aware" in text and "round-robin" in text
    data = json.loads(out.read_text())
    assert [(r["policy"], r["engines"]) for r in data["results"]] == [
        ("kv-aware", 2), ("round-robin", 2), ("kv-aware", 3), ("round-robin", 3)]
    assert data["meta"]["requests"] == 120


def test_simulate_cli_wire_and_router_index_flags_give_the_same_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--requests", "80", "--duration", "3", "--engines", "2", "--policies", "kv-aware", "--quiet"]
    outs = []
    for extra in ([], ["--wire"], ["--router-index", "token"]):
        out = tmp_path / f"r{len(extra)}.json"
        assert main([*args, *extra, "--json", str(out)]) == 0
        capsys.readouterr()
        data = json.loads(out.read_text())
        assert data["meta"]["wire"] is ("--wire" in extra)
        outs.append([{k: v for k, v in r.items() if "wall" not in k}
                     for r in data["results"]])
    assert outs[0] == outs[1] == outs[2]


def test_simulate_cli_reports_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--policies", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot open trace" in capsys.readouterr().err


def _wire_and_direct(reqs, cfg: SimConfig, policy: str):
    from dataclasses import replace

    from kvstream.sim.run import SimRun

    direct = SimRun(reqs, policy, replace(cfg, wire=False))
    wired = SimRun(reqs, policy, replace(cfg, wire=True))
    return direct, direct.run(), wired, wired.run()


@pytest.mark.parametrize("policy", ["kv-aware", "kv-load", "prefix-only"])
def test_events_through_the_codec_give_the_same_run_as_the_event_objects(policy: str) -> None:
    for cfg in (SMALL, SimConfig(engines=3, engine=SMALL.engine, router_lag_s=0.3, seed=7)):
        direct, a, wired, b = _wire_and_direct(_workload(), cfg, policy)
        assert a.deterministic() == b.deterministic()
        assert direct.index.state() == wired.index.state()
        assert a.events > 0


def test_mooncake_events_through_the_codec_give_the_same_run(mooncake_trace: Path) -> None:
    reqs = load_mooncake(mooncake_trace, limit=1200)
    cfg = SimConfig(engines=8, engine=EngineConfig(num_blocks=256, block_size=512, token_granularity=32))
    direct, a, wired, b = _wire_and_direct(reqs, cfg, "kv-aware")
    assert a.deterministic() == b.deterministic()
    assert direct.index.state() == wired.index.state()
    assert a.events > 10_000 and a.hit_rate > 0


@pytest.mark.parametrize("policy", ["kv-aware", "kv-load", "prefix-only"])
def test_engine_keyed_and_token_keyed_routers_make_the_same_decisions(policy: str) -> None:
    from dataclasses import replace

    from kvstream.routing.engine_index import EngineKeyIndex
    from kvstream.routing.index import KVIndex
    from kvstream.sim.run import SimRun

    for cfg in (SMALL, SimConfig(engines=3, engine=SMALL.engine, router_lag_s=0.3, seed=7)):
        eng = SimRun(_workload(), policy, replace(cfg, router_index="engine"))
        tok = SimRun(_workload(), policy, replace(cfg, router_index="token"))
        assert isinstance(eng.index, EngineKeyIndex) and isinstance(tok.index, KVIndex)
        a, b = eng.run(), tok.run()
        assert a.deterministic() == b.deterministic()
        assert a.hit_rate > 0


def test_mooncake_engine_keyed_router_gives_the_same_run(mooncake_trace: Path) -> None:
    from dataclasses import replace

    reqs = load_mooncake(mooncake_trace, limit=1200)
    cfg = SimConfig(engines=8, engine=EngineConfig(num_blocks=256, block_size=512, token_granularity=32))
    a, b = (compare(reqs, ["kv-aware"], replace(cfg, router_index=m))[0] for m in ("engine", "token"))
    assert a.deterministic() == b.deterministic() and a.hit_rate > 0


def test_engine_keyed_router_needs_engine_sized_router_blocks() -> None:
    with pytest.raises(WorkloadError, match="router_index='token'"):
        SimConfig(engine=SMALL.engine, router_block_size=SMALL.engine.sim_block_size * 2)


def test_model_config_sizes_engines_and_a_config_without_context_length_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.conftest import REPO

    cfg = REPO / "examples" / "configs" / "llama-3-8b.json"
    args = ["simulate", "--requests", "30", "--engines", "2", "--policies", "kv-aware", "--quiet",
            "--kv-memory-gib", "2", "--json", str(tmp_path / "r.json")]
    assert main([*args, "--model-config", str(cfg)]) == 0
    blocks = json.loads((tmp_path / "r.json").read_text())["meta"]["engine"]["num_blocks"]
    assert blocks == 2 * (1 << 30) // (32 * 2 * 16 * 8 * 128 * 2)  # layers x K,V x block x heads x dim x bf16
    capsys.readouterr()
    bare = json.loads(cfg.read_text())
    bare.pop("max_position_embeddings")
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    assert main([*args, "--model-config", str(tmp_path / "bare.json")]) == 2
    assert "no context length" in capsys.readouterr().err


# -- conventions and what the table tells -----------------------------------------------

def _options(command: str) -> set[str]:
    import argparse

    from kvstream.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o for a in sub.choices[command]._actions for o in a.option_strings}


def test_simulate_and_plan_share_vllm_flag_names() -> None:
    shared = {"--block-size", "--max-num-batched-tokens", "--num-gpu-blocks-override", "--gpu-memory",
              "--gpu-memory-utilization", "--max-model-len", "--model-config"}
    assert shared <= _options("simulate") and shared <= _options("plan")
    # vLLM's names, with the old spellings kept as aliases
    assert {"--max-num-seqs", "--max-running", "--max-batched-tokens", "--blocks", "--hash-algo",
            "--prefix-caching-hash-algo", "--kv-overlap-score-weight"} <= _options("simulate")


def _json_run(tmp_path: Path, *extra: str) -> list[dict]:
    out = tmp_path / f"r{abs(hash(extra))}.json"
    assert main(["simulate", "--requests", "150", "--duration", "3", "--engines", "3", "--quiet",
                 "--policies", "kv-aware", "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_old_and_vllm_spellings_run_the_same_simulation(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    a = _json_run(tmp_path, "--max-running", "8", "--max-batched-tokens", "1024", "--blocks", "300",
                  "--prefill-rate", "9000")
    warned = capsys.readouterr().err
    for old, new in (("--max-running", "--max-num-seqs"), ("--max-batched-tokens", "--max-num-batched-tokens"),
                     ("--blocks", "--num-gpu-blocks-override"), ("--prefill-rate", "--prefill-tokens-per-s")):
        assert f"kvstream simulate: warning: {old} is deprecated; use {new}" in warned
    b = _json_run(tmp_path, "--max-num-seqs", "8", "--max-num-batched-tokens", "1024",
                  "--num-gpu-blocks-override", "300", "--prefill-tokens-per-s", "9000")
    assert "deprecated" not in capsys.readouterr().err
    strip = ("wall_seconds", "requests_per_wall_s", "events_per_wall_s")
    assert [{k: v for k, v in r.items() if k not in strip} for r in a["results"]] == \
           [{k: v for k, v in r.items() if k not in strip} for r in b["results"]]
    assert a["meta"]["engine"]["max_running"] == 8


def test_routing_weights_from_the_cli_change_the_kv_aware_decisions(tmp_path: Path) -> None:
    default = _json_run(tmp_path)
    blind = _json_run(tmp_path, "--kv-overlap-score-weight", "0", "--queue-weight", "1")
    assert blind["meta"]["kv_scoring"]["prefix_weight"] == 0.0 and default["meta"]["kv_scoring"] is None
    assert blind["results"][0]["hit_rate"] < default["results"][0]["hit_rate"]


def test_reuse_ceiling_bounds_every_policy_and_an_unbounded_engine_nears_it() -> None:
    from kvstream.sim.ceiling import reuse_ceiling

    reqs = _workload(3)
    c = reuse_ceiling(reqs, SMALL.engine)
    assert 0 < c.hit_rate < 1 and c.distinct_blocks > 0
    for r in compare(reqs, POLICY_NAMES, SMALL):
        assert r.hit_rate <= c.hit_rate
    huge = SimConfig(engines=1, engine=EngineConfig(num_blocks=c.distinct_blocks + 100, block_size=16,
                                                    max_running=1024))
    one = simulate(reqs, "round-robin", huge)
    assert one.preemptions == 0 and 0.9 * c.hit_rate <= one.hit_rate <= c.hit_rate


def test_simulate_prints_the_ceiling_and_the_capacity_beside_the_hit_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--requests", "100", "--duration", "2", "--engines", "2", "--quiet",
                 "--policies", "kv-aware,round-robin", "--num-gpu-blocks-override", "500"]) == 0
    out = capsys.readouterr().out
    assert "of best %" in out.splitlines()[0]
    assert "reuse ceiling:" in out
    assert "cache capacity: 2 engines x 500 blocks x 16 tokens = 1,000 blocks (16,000 tokens)" in out


def test_the_default_synthetic_workload_is_sized_to_the_engines(tmp_path: Path) -> None:
    """First contact: `kvstream simulate` with no workload flags is not overloaded. The
    built-in workload offers 2 requests/s per engine of the smallest engine count, which
    KV-aware routing serves without queueing or preemptions."""
    out = tmp_path / "d.json"
    assert main(["simulate", "--engines", "4,8", "--policies", "kv-aware", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["synthetic"] == {"requests": 2000, "duration": 250.0, "seed": 0}
    for r in doc["results"]:
        assert r["preemptions"] == 0 and r["ttft_p99_s"] < 1.0, r


def test_the_table_is_the_same_in_every_run_no_wall_clock_column(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--requests", "150", "--duration", "3", "--engines", "2", "--quiet",
            "--policies", "kv-aware,round-robin"]
    tables = []
    for _ in range(2):
        assert main(argv) == 0
        tables.append(capsys.readouterr().out.split("\n\n")[0])
    assert tables[0] == tables[1]
    head = tables[0].splitlines()[0]
    assert "index ev/s" in head and "events/s" not in head
    rows = [line.split() for line in tables[0].splitlines()[2:]]
    assert rows[0][-2] != rows[1][-2]  # the policies churn the index differently
