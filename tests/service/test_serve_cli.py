"""``kvstream serve``'s command line: config file and flags, tokenizer, structured logs, and
bad configuration as one clear line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.service.conftest import REPO


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstream", "serve", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("args, says", [
    (["e0=nope"], "is not an endpoint"),
    (["e0=tcp://h:1,http=ftp://x"], "http= must be an http"),
    (["e0=tcp://h:1", "e0=tcp://h:2"], "given twice"),
    (["--port", "70000", "e0=tcp://h:1"], "port must be 0..65535"),
    (["--tokenizer", "/nonexistent/tok.json"], "does not exist"),
    (["--load-interval", "-1"], "load-interval must be"),
])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    r = _run(*args)
    assert r.returncode == 2, r
    assert says in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("text, says", [
    ("port = \n", "not valid TOML"),
    ("prot = 1\n", "unknown field `prot`"),
    ('load-interval = "fast"\n', "Expected `float`, got `str` - at `$.load-interval`"),
    ('engines = ["e0=tcp://h:1,bogus=1"]\n', "bad option"),
])
def test_bad_config_files_name_the_key(tmp_path, text: str, says: str) -> None:
    f = tmp_path / "serve.toml"
    f.write_text(text)
    r = _run("--config", str(f))
    assert r.returncode == 2 and says in r.stderr and str(f) in r.stderr, r.stderr


def test_prompts_are_tokenized_with_a_local_tokenizer_and_logs_are_json(engines, serve, tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(200)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "model").mkdir()
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    text = " ".join(words[:64])
    ids = tok.encode(text).ids
    assert len(ids) == 64

    e0, e1 = engines("e0"), engines("e1")
    srv = serve(e0.arg, e1.arg, "--tokenizer", str(tmp_path / "model"), "--log-format", "json",
                "--log-level", "debug", "--load-interval", "0")
    seq = e0.admit(ids, "r")
    srv.wait_applied("e0", seq)
    r = srv.route(prompt=text + " w1 w2")
    assert r["engine"] == "e0" and r["matched_tokens"] == 64
    assert srv.route(token_ids=ids) == r | {"scores": r["scores"]}
    lines = [json.loads(x) for x in srv.stderr().splitlines() if x.strip()]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    assert any(x["msg"].startswith("following 2 engine") for x in lines)


def test_prompt_without_a_tokenizer_is_a_clear_4xx(serve) -> None:
    srv = serve("e0=tcp://127.0.0.1:1", "--load-interval", "0")
    r = srv.client.post("/v1/route", json={"prompt": "hello"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "no_tokenizer" and "--tokenizer" in r.json()["error"]["message"]
