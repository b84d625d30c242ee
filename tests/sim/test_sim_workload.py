"""The simulator's workloads: Mooncake loading and expansion, the synthetic generator, time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstream.sim.workload import (
    MOONCAKE_BLOCK_TOKENS,
    SyntheticConfig,
    TimeScale,
    WorkloadError,
    compress_arrivals,
    expand_segments,
    iter_mooncake,
    load_mooncake,
    parse_speed,
    segment_tokens,
    synthetic_workload,
)


def _write(tmp_path: Path, rows: list[object]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def _row(ts: float, n: int, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def test_equal_hash_ids_expand_to_equal_prefix_tokens(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(0, 1500, [7, 8, 9]), _row(5, 1100, [7, 8, 3]), _row(9, 600, [4, 8])])
    a, b, c = load_mooncake(path)
    ta, tb, tc = a.prompt_tokens(), b.prompt_tokens(), c.prompt_tokens()
    assert (len(ta), len(tb), len(tc)) == (1500, 1100, 600)
    assert ta[:1024] == tb[:1024]  # ids 7, 8 shared
    assert ta[1024:1100] != tb[1024:1100]  # 9 vs 3
    # id 8 at another position gives the same block tokens, but the prefix differs
    assert tc[512:600] == ta[512:600]
    assert tc[:512] != ta[:512]


def test_cut_last_block_is_a_prefix_of_the_full_block(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(0, 1024, [1, 2]), _row(1, 700, [1, 2])])
    full, cut = load_mooncake(path)
    assert cut.prompt_tokens() == full.prompt_tokens()[:700]
    assert cut.prompt == ((1, 512), (2, 188))


def test_tokens_are_deterministic_and_in_vocab() -> None:
    t1 = segment_tokens(12345, 512).tolist()
    t2 = segment_tokens(12345, 512).tolist()
    assert t1 == t2 and len(t1) == 512
    assert all(0 <= t < 1 << 16 for t in t1)
    assert segment_tokens(12346, 512).tolist() != t1
    assert expand_segments([(1, 3), (2, 2)]) == segment_tokens(1, 3).tolist() + segment_tokens(2, 2).tolist()


def test_outputs_never_share_tokens_with_prompt_blocks(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(0, 512, [0], out=512), _row(0, 512, [1], out=512)])
    a, b = load_mooncake(path)
    assert a.output_tokens() != b.output_tokens()
    assert a.output_tokens() != a.prompt_tokens()


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "hash_ids"),
        (json.dumps(_row(0, 1025, [1, 2])), "needs 3 hash ids"),
        (json.dumps(_row(-1, 10, [1])), "timestamp"),
        (json.dumps(_row(0, 0, [])), "input_length"),
        (json.dumps(_row(0, 10, [1], out=-3)), "output_length"),
        (json.dumps(_row(0, 10, [-1])), "hash id -1"),
        (json.dumps({"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}), "input_length"),
    ],
)
def test_bad_trace_line_names_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = _write(tmp_path, [_row(0, 10, [1]), "", line])
    with pytest.raises(WorkloadError) as info:
        load_mooncake(path)
    msg = str(info.value)
    assert f"{path}:3:" in msg and fragment in msg


def test_missing_trace_file_is_a_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot open trace"):
        load_mooncake(tmp_path / "nope.jsonl")


def test_loader_streams_with_limit_and_sorts(tmp_path: Path) -> None:
    path = _write(tmp_path, [_row(2000, 10, [1]), _row(1000, 10, [2]), _row(1000, 10, [3])])
    assert [r.source_line for r in iter_mooncake(path, limit=2)] == [1, 2]
    reqs = load_mooncake(path)
    assert [r.arrival for r in reqs] == [1.0, 1.0, 2.0]
    assert [r.source_line for r in reqs] == [2, 3, 1]
    assert [r.request_id for r in reqs] == [0, 1, 2]


def test_zero_output_length_is_raised_to_one_token(tmp_path: Path) -> None:
    (r,) = load_mooncake(_write(tmp_path, [_row(0, 10, [1], out=0)]))
    assert r.output_len == 1


def test_mooncake_conversation_trace_loads(mooncake_trace: Path) -> None:
    reqs = load_mooncake(mooncake_trace)
    assert len(reqs) == 12031
    assert all(r.prompt_len > 0 for r in reqs)
    assert reqs[-1].arrival == pytest.approx(3536.999)
    assert all(len(r.prompt) == math.ceil(r.prompt_len / MOONCAKE_BLOCK_TOKENS) for r in reqs[:500])


def test_synthetic_workload_is_deterministic_per_seed() -> None:
    cfg = SyntheticConfig(requests=300, duration=10.0, seed=3)
    assert synthetic_workload(cfg) == synthetic_workload(cfg)
    other = synthetic_workload(SyntheticConfig(requests=300, duration=10.0, seed=4))
    assert other != synthetic_workload(cfg)


def test_synthetic_turn_extends_previous_prompt_and_output() -> None:
    reqs = synthetic_workload(SyntheticConfig(requests=400, duration=10.0, seed=1))
    assert len(reqs) == 400
    assert all(0 <= r.arrival < 10.0 for r in reqs)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    by_session: dict[int, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi, "some conversation has several turns"
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            expect = prev.prompt_tokens() + prev.output_tokens()
            assert nxt.prompt_tokens()[: len(expect)] == expect
            assert nxt.prompt_len > len(expect)


def test_synthetic_system_prompts_are_shared_across_conversations() -> None:
    reqs = synthetic_workload(SyntheticConfig(requests=200, system_prompts=2, seed=0))
    firsts = {r.prompt[0] for r in reqs}
    assert len(firsts) == 2


@pytest.mark.parametrize(
    "kwargs", [{"requests": 0}, {"duration": 0}, {"turns_mean": 0.5}, {"user_tokens_mean": 0}]
)
def test_bad_synthetic_setting_is_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(WorkloadError, match="SyntheticConfig"):
        SyntheticConfig(**kwargs)  # type: ignore[arg-type]


def test_compress_arrivals_divides_times_only() -> None:
    reqs = synthetic_workload(SyntheticConfig(requests=50, seed=0))
    fast = compress_arrivals(reqs, 4.0)
    assert [r.arrival * 4.0 for r in fast] == pytest.approx([r.arrival for r in reqs])
    assert [r.prompt for r in fast] == [r.prompt for r in reqs]
    with pytest.raises(WorkloadError):
        compress_arrivals(reqs, 0)


def test_speed_parsing() -> None:
    assert parse_speed("max").virtual
    assert parse_speed("10x") == TimeScale(10.0)
    assert parse_speed("1").wall_seconds(3.0) == 3.0
    assert parse_speed("4x").wall_seconds(2.0) == 0.5
    assert parse_speed("inf").wall_seconds(2.0) == 0.0
    for bad in ("fast", "0x", "-2"):
        with pytest.raises(WorkloadError, match="speed"):
            parse_speed(bad)


@pytest.mark.parametrize("kind", ["xz", "gz"])
def test_compressed_traces_read_as_the_plain_file(tmp_path: Path, kind: str) -> None:
    import gzip
    import lzma

    plain = _write(tmp_path, [_row(0, 600, [1, 2]), _row(5, 10, [1], out=3)])
    packed = tmp_path / f"trace.jsonl.{kind}"
    packed.write_bytes((lzma.compress if kind == "xz" else gzip.compress)(plain.read_bytes()))
    assert load_mooncake(packed) == load_mooncake(plain)


def test_a_truncated_compressed_trace_is_a_workload_error(tmp_path: Path) -> None:
    import lzma

    rows = [_row(i, 600, [i, i + 1]) for i in range(2000)]
    data = lzma.compress(_write(tmp_path, rows).read_bytes())
    cut = tmp_path / "cut.jsonl.xz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(WorkloadError, match="cannot be decompressed"):
        load_mooncake(cut)


def test_the_shipped_trace_is_the_whole_mooncake_conversation_trace(mooncake_trace: Path) -> None:
    import hashlib
    import lzma

    assert mooncake_trace.stat().st_size < 300_000  # shipped compressed
    digest = hashlib.sha256(lzma.decompress(mooncake_trace.read_bytes())).hexdigest()
    assert digest == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"  # examples/traces/README.md
