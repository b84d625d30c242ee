"""``kvstream plan`` on every example config, table and JSON, plus flags and errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvstream.cli import main
from kvstream.cli.plan import parse_memory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
CONFIGS = sorted(EXAMPLES.glob("*.json"))
GIB = 1 << 30


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_examples_cover_every_family_the_issue_names():
    names = {p.stem for p in CONFIGS}
    assert {"llama-3-8b", "mistral-7b-v0.1", "gemma-2-9b", "gemma-3-1b", "deepseek-v2-lite",
            "jamba-v0.1", "mamba-2.8b"} <= names


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_example_plans_as_a_table(capsys, config):
    code, out, err = run(capsys, str(config), "--gpu-memory", "80GiB", "--model-weights-gib", "16",
                         "--max-model-len", "4096")
    assert code == 0, err
    assert out.startswith("KV cache plan")
    for label in ("num blocks", "KV cache size", "max concurrency", "padding:"):
        assert label in out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_example_plans_as_json_within_its_memory(capsys, config):
    plan = run_json(capsys, str(config), "--gpu-memory", "80", "--model-weights-gib", "16",
                    "--max-model-len", "4096")
    assert plan["source"] == str(config)
    assert plan["memory"]["kv_cache_bytes"] == int(80 * GIB * 0.9) - 16 * GIB
    assert plan["num_blocks"] > 0 and plan["kv_cache_tokens"] > 0
    assert plan["max_concurrency"] >= 1.0
    for w in plan["workers"]:
        assert 0 < w["kv_cache_bytes"] <= plan["memory"]["kv_cache_bytes"]
        covered = [name for t in w["tensors"] for name in t["shared_by"]]
        assert sorted(covered) == sorted(set(covered))  # no layer in two tensors
        assert len(covered) == w["num_layers"]


def test_llama_numbers_match_a_hand_computation(capsys):
    plan = run_json(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "80GiB",
                    "--model-weights-gib", "16")
    page = 2 * 16 * 8 * 128 * 2  # per layer per block
    kv = int(80 * GIB * 0.9) - 16 * GIB  # 56 GiB
    assert plan["max_model_len"] == 8192  # the config's max_position_embeddings
    assert plan["num_blocks"] == kv // (page * 32) == 28_672
    assert plan["kv_cache_tokens"] == 28_672 * 16
    assert plan["max_concurrency"] == 28_672 / 512
    assert plan["groups"][0]["page_size_bytes"] == page


def test_explicit_dimensions_give_the_same_plan_as_the_config(capsys):
    from_config = run_json(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "40")
    from_flags = run_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                          "--dtype", "bf16", "--max-model-len", "8192", "--gpu-memory", "40")
    for key in ("num_blocks", "kv_cache_tokens", "max_concurrency", "memory_per_request_bytes"):
        assert from_config[key] == from_flags[key]


def test_flags_override_config_fields(capsys):
    plan = run_json(capsys, str(EXAMPLES / "llama-3-8b.json"), "--layers", "16",
                    "--gpu-memory", "40")
    assert len(plan["groups"][0]["layers"]) == 16


def test_padding_waste_is_reported(capsys):
    code, out, _ = run(capsys, str(EXAMPLES / "gemma-3-1b.json"), "--gpu-memory", "24",
                       "--non-kv-memory", "4GiB")
    assert code == 0
    assert "2 layer slot(s) on the 22 sliding_window layers: up to 9.09%" in out
    assert "2 of 28 layer slots are padding (7.14% of the pool)" in out
    plan = run_json(capsys, str(EXAMPLES / "gemma-3-1b.json"), "--gpu-memory", "24")
    assert plan["padding"] == [{"kind": "sliding_window", "num_layers": 22,
                                "num_padding_layers": 2, "max_waste_fraction": 2 / 22}]


def test_no_hybrid_warns_about_the_memory_cost(capsys):
    code, out, _ = run(capsys, str(EXAMPLES / "gemma-2-9b.json"), "--gpu-memory", "80",
                       "--no-hybrid")
    assert code == 0
    assert "warning: hybrid KV cache management is off: 21" in out
    assert "instead of" in out
    on = run_json(capsys, str(EXAMPLES / "gemma-2-9b.json"), "--gpu-memory", "80")
    off = run_json(capsys, str(EXAMPLES / "gemma-2-9b.json"), "--gpu-memory", "80", "--no-hybrid")
    assert off["rule"] == "uniform_spec" and on["rule"] == "uniform_page_size"
    assert off["max_concurrency"] < on["max_concurrency"]


def test_not_enough_memory_exits_1_with_the_longest_length_that_fits(capsys):
    code, out, err = run(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "20",
                         "--model-weights-gib", "16", "--max-model-len", "65536")
    assert code == 1 and out == ""
    assert "8.00 GiB" in err and "2.00 GiB" in err and "16384" in err
    code, out, _ = run(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "20",
                       "--model-weights-gib", "16", "--max-model-len", "65536", "--json")
    err_doc = json.loads(out)
    assert code == 1 and err_doc["error"] == "NotEnoughKVCacheMemoryError"
    assert err_doc["estimated_max_model_len"] == 16384
    assert err_doc["needed_bytes"] == 8 * GIB and err_doc["available_bytes"] == 2 * GIB


def test_tensor_and_pipeline_parallel_split_heads_and_layers(capsys):
    plan = run_json(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "80",
                    "-tp", "16", "-pp", "2", "--model-weights-gib", "16")
    assert plan["groups"][0]["spec"]["num_kv_heads"] == 1  # 8 heads replicated over 16 ranks
    assert [w["num_layers"] for w in plan["workers"]] == [16, 16]
    assert plan["memory"]["weights_per_gpu_bytes"] == 16 * GIB // 32
    code, _, err = run(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "80", "-tp", "3")
    assert code == 1 and "split evenly" in err


def test_block_count_override(capsys):
    plan = run_json(capsys, str(EXAMPLES / "mistral-7b-v0.1.json"), "--gpu-memory", "80",
                    "--num-gpu-blocks-override", "1000")
    assert plan["num_blocks"] == 1000 and plan["num_gpu_blocks_override"] == 1000


def test_zero_layers_is_attention_free(capsys):
    code, out, _ = run(capsys, "--layers", "0", "--max-model-len", "2048", "--gpu-memory", "8")
    assert code == 0 and "no KV cache" in out


def test_missing_dimensions_and_bad_files_are_clear_errors(capsys, tmp_path):
    code, _, err = run(capsys, "--gpu-memory", "80")
    assert code == 1 and "--layers --kv-heads --head-dim" in err
    code, _, err = run(capsys, "--layers", "4", "--kv-heads", "2", "--gpu-memory", "80",
                       "--max-model-len", "64")
    assert code == 1 and "--head-dim" in err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, str(tmp_path), "--gpu-memory", "80")
    assert code == 1 and "not valid JSON" in err
    code, _, err = run(capsys, str(tmp_path / "absent.json"), "--gpu-memory", "80")
    assert code == 1 and "cannot read" in err


def test_nested_text_config_is_read(capsys, tmp_path):
    text = json.loads((EXAMPLES / "gemma-3-1b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": text}))
    nested = run_json(capsys, str(tmp_path), "--gpu-memory", "24")
    flat = run_json(capsys, str(EXAMPLES / "gemma-3-1b.json"), "--gpu-memory", "24")
    assert nested["num_blocks"] == flat["num_blocks"] and nested["rule"] == "uniform_page_size"


def test_no_reserved_memory_and_too_long_length_are_noted(capsys):
    plan = run_json(capsys, str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "80",
                    "--max-model-len", "16384")
    assert any("no memory reserved" in n for n in plan["notes"])
    assert any("exceeds the model's max_position_embeddings 8192" in n for n in plan["notes"])


@pytest.mark.parametrize("text,expected", [
    ("80", 80 * GIB), ("80GiB", 80 * GIB), ("80G", 80 * GIB), ("80GB", 80 * 10**9),
    ("512MiB", 512 << 20), ("1.5TiB", int(1.5 * (1 << 40))), ("0.5", GIB // 2),
])
def test_memory_sizes_parse(text, expected):
    assert parse_memory(text) == expected


def test_bad_memory_size_is_a_usage_error(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="invalid memory size"):
        parse_memory("80 parsecs")
    with pytest.raises(SystemExit) as info:
        main(["plan", str(EXAMPLES / "llama-3-8b.json"), "--gpu-memory", "lots"])
    assert info.value.code == 2
