"""One vocabulary across commands: one flag name per concept (vLLM's or Dynamo's where they
have one), the older spellings kept as deprecated aliases that warn, an unknown flag told
by the sub-command itself, and help texts without reStructuredText markup."""

from __future__ import annotations

import argparse
import re

import pytest

from kvstream.cli import build_parser, main

from .helpers import one_clear_line, run


def _sub(command: str) -> argparse.ArgumentParser:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[command]
    return parser


def _shown(command: str) -> set[str]:
    """The option strings ``kvstream COMMAND --help`` shows."""
    return {o for a in _sub(command)._actions if a.help != argparse.SUPPRESS for o in a.option_strings}


# concept -> (the one name, the commands that have the concept)
CONCEPTS = {
    "KV blocks per engine": ("--num-gpu-blocks-override", ("engine", "simulate", "plan")),
    "prefill speed": ("--prefill-tokens-per-s", ("engine", "simulate")),
    "running requests per engine": ("--max-num-seqs", ("engine", "simulate")),
    "tokens per step": ("--max-num-batched-tokens", ("engine", "simulate", "plan")),
    "block hash algorithm": ("--prefix-caching-hash-algo", ("engine", "simulate")),
    "weight of the cached prefix": ("--kv-overlap-score-weight", ("serve", "simulate")),
    "weight of KV usage": ("--kv-usage-weight", ("serve", "simulate")),
    "queue weight": ("--queue-weight", ("serve", "simulate")),
    "running weight": ("--running-weight", ("serve", "simulate")),
    "tensor parallel size": ("--tensor-parallel-size", ("plan",)),
    "pipeline parallel size": ("--pipeline-parallel-size", ("plan",)),
    "log level": ("--log-level", ("serve", "engine", "simulate", "subscribe", "record", "relay", "replay")),
}

# the old spelling -> (command, the current name, arguments for a parse that needs no more)
DEPRECATED = {
    "--num-gpu-blocks": ("engine", "--num-gpu-blocks-override", ["64"]),
    "--blocks": ("simulate", "--num-gpu-blocks-override", ["64"]),
    "--prefill-rate": ("simulate", "--prefill-tokens-per-s", ["5000"]),
    "--max-running": ("simulate", "--max-num-seqs", ["4"]),
    "--max-batched-tokens": ("simulate", "--max-num-batched-tokens", ["512"]),
    "--hash-algo": ("simulate", "--prefix-caching-hash-algo", ["xxhash"]),
    "--prefix-weight": ("serve", "--kv-overlap-score-weight", ["2.5"]),
    "--kv-weight": ("serve", "--kv-usage-weight", ["0.5"]),
    "--workers": ("serve", "--processes", ["3"]),
    "--tensor-parallel": ("plan", "--tensor-parallel-size", ["2"]),
    "--pipeline-parallel": ("plan", "--pipeline-parallel-size", ["2"]),
}
PLAN_NEEDS = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--max-model-len", "1024", "--gpu-memory", "8"]


@pytest.mark.parametrize("concept", sorted(CONCEPTS))
def test_a_concept_has_one_flag_name_in_every_command_that_has_it(concept: str) -> None:
    name, commands = CONCEPTS[concept]
    for command in commands:
        assert name in _shown(command), (command, name)


def test_no_command_shows_a_deprecated_spelling_in_its_help() -> None:
    for old, (command, _, _) in DEPRECATED.items():
        assert old not in _shown(command), (command, old)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_an_old_spelling_parses_as_the_new_one_with_one_warning_line(old: str, capsys: pytest.CaptureFixture[str]) -> None:
    command, new, value = DEPRECATED[old]
    extra = PLAN_NEEDS if command == "plan" else []
    a = build_parser().parse_args([command, *extra, old, *value])
    warned = capsys.readouterr().err.splitlines()
    b = build_parser().parse_args([command, *extra, new, *value])
    assert capsys.readouterr().err == ""
    assert vars(a) == vars(b)
    assert warned == [f"kvstream {command}: warning: {old} is deprecated; use {new} (same meaning)"]


def test_serve_processes_refuses_a_dynamo_engine_list_naming_the_engine_arguments() -> None:
    r = run("serve", "--workers", "0=tcp://127.0.0.1:5557")
    one_clear_line(r, "kvstream serve:", "engine list", "ENGINE arguments", "--processes", code=2)


def test_serve_config_file_takes_the_new_weight_names_and_refuses_both_spellings(tmp_path) -> None:
    from kvstream.service.config import ConfigError, load_file

    good = tmp_path / "good.toml"
    good.write_text("kv-overlap-score-weight = 2.0\nkv-usage-weight = 0.5\n")
    assert load_file(str(good)) == {"prefix_weight": 2.0, "kv_weight": 0.5}
    both = tmp_path / "both.toml"
    both.write_text("kv-overlap-score-weight = 2.0\nprefix-weight = 1.0\n")
    with pytest.raises(ConfigError, match="both kv-overlap-score-weight and its older spelling prefix-weight"):
        load_file(str(both))


NEEDED = {"record": ["tcp://127.0.0.1:5557", "-o", "x.kvlog"], "plan": PLAN_NEEDS,
          "relay": ["tcp://127.0.0.1:5557", "--nats", "nats://127.0.0.1:4222"], "replay": ["x.kvlog", "--publish", "tcp://127.0.0.1:6557"]}


@pytest.mark.parametrize("command", ["simulate", "engine", "serve", "record", "plan", "relay", "replay"])
def test_an_unknown_flag_names_the_subcommands_own_help(command: str) -> None:
    r = run(command, *NEEDED.get(command, []), "--no-such-flag")
    one_clear_line(r, f"kvstream {command}: error: unrecognized arguments: --no-such-flag",
                   f"(see `kvstream {command} --help`)", code=2)


_RST = re.compile(r"``|:[a-z]+:`|::\s*$", re.M)


def test_no_help_text_shows_restructuredtext_markup() -> None:
    top = build_parser()
    assert not _RST.search(top.format_help())
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert not _RST.search(text), (name, _RST.search(text))


def test_relay_takes_log_level() -> None:
    args = build_parser().parse_args(["relay", "e0=tcp://127.0.0.1:5557", "--nats", "nats://127.0.0.1:4222",
                                      "--log-level", "debug"])
    assert args.log_level == "debug"


def test_version_still_runs() -> None:
    assert main(["version"]) == 0


def test_serve_processes_must_be_at_least_one() -> None:
    one_clear_line(run("serve", "--processes", "0"), "kvstream serve: error: argument --processes",
                   "at least 1 process", code=2)
