"""Every shell block in the README and ``docs/`` is checked, so the docs cannot drift
from the commands.

* A fenced block tagged ``bash``, ``sh``, ``shell`` or ``console`` is a shell block. Each
  ``kvstream ...`` command in it (after an optional ``$`` prompt, with ``\\`` line
  continuations joined, split at ``|``, ``&&``, ``;`` and ``&``) is parsed by the CLI's
  own argparse parser: a flag that does not exist, a bad value or a deprecated spelling
  fails. Its engine arguments go through the same endpoint checks the command makes
  before it starts (``NAME=PUB,REPLAY`` pairing, ``--replay`` per position).
* Commands that are self-contained and fast are run as written, in a folder where the
  repository's ``examples/`` and ``tests/data/`` are at hand (``plan``, ``inspect`` and
  ``convert`` of the shipped captures, ``version``): they must exit 0, or, when the doc
  shows ``kvstream CMD: error: ...`` right after the command, fail with that message.
* An untagged block must not hold a ``kvstream`` command line (tag it ``bash``/``console``
  to have it checked, or ``text`` for a synopsis).
* A ``python`` block must compile (top-level ``await`` allowed: they are fragments of an
  async program) and every name it imports from ``kvstream`` must exist.
* The README's test command is the line ``.ci/run`` runs.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstream.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md",
         REPO / "tests" / "data" / "golden" / "README.md", REPO / "examples" / "traces" / "README.md"]
SHELL = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]
    shown_error: str | None  # the "kvstream CMD: error: ..." line the doc shows after it

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: kvstream {shlex.join(self.argv)}"


def _blocks() -> list[tuple[str, int, str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            out.append((str(page.relative_to(REPO)), text[: m.start()].count("\n") + 2, m.group(1), m.group(2)))
    return out


def _logical_lines(body: str, first: int) -> list[tuple[int, str, str | None]]:
    """(line number, command text, the output line after it) for a shell block."""
    raw = body.splitlines()
    out = []
    i = 0
    while i < len(raw):
        start, line = i, raw[i]
        while line.endswith("\\") and i + 1 < len(raw):
            i += 1
            line = line[:-1] + " " + raw[i].strip()
        i += 1
        after = raw[i].strip() if i < len(raw) else None
        out.append((first + start, line, after))
    return out


_SPLIT = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "<"}


def _kvstream_commands(text: str) -> list[list[str]]:
    """The argument lists of every ``kvstream`` command on one shell line."""
    lex = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        tokens = list(lex)
    except ValueError as exc:
        raise AssertionError(f"cannot be parsed as a shell line ({exc}): {text}") from None
    segments: list[list[str]] = [[]]
    skip = False
    for tok in tokens:
        if tok in _SPLIT or set(tok) <= set("|&;<>"):
            skip = tok in (">", ">>", "2>", "<")  # the next word is a file name
            segments.append([])
            continue
        if skip:
            skip = False
            continue
        segments[-1].append(tok)
    out = []
    for seg in segments:
        if seg and seg[0] == "sh" and len(seg) >= 3 and seg[1] == "-c":  # sh -c '... && kvstream ...'
            out += _kvstream_commands(seg[2])
            continue
        for k, tok in enumerate(seg):
            if tok.endswith("kvstream") and (k == 0 or seg[k - 1] in ("-m",)) and "=" not in tok:
                out.append(seg[k + 1:])
                break
    return out


def _commands() -> list[Command]:
    cmds = []
    for page, first, lang, body in _blocks():
        if lang not in SHELL:
            continue
        for line_no, text, after in _logical_lines(body, first):
            text = text.strip()
            if text.startswith("$ "):
                text = text[2:]
            elif lang == "console":
                continue  # a console block shows commands after "$ ", the rest is their output
            if text.startswith("#") or "kvstream" not in text:
                continue
            shown = after if after and re.match(r"kvstream [a-z]+: error: ", after) else None
            for argv in _kvstream_commands(text):
                cmds.append(Command(page, line_no, tuple(argv), shown))
    return cmds


COMMANDS = _commands()


def test_the_docs_hold_many_commands_to_check() -> None:
    assert len(COMMANDS) >= 60, [str(c) for c in COMMANDS]
    assert {c.argv[0] for c in COMMANDS if c.argv} >= {"demo", "simulate", "plan", "engine", "serve", "subscribe",
                                                      "record", "relay", "inspect", "replay", "convert"}


def _parse(argv: tuple[str, ...]) -> tuple[object, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(list(argv))
        except SystemExit as exc:
            raise AssertionError(f"argparse refused it (exit {exc.code}): {err.getvalue().strip()}") from None
    return args, err.getvalue()


def _check_endpoints(args: object) -> None:
    """What each command checks about its engine arguments before it starts."""
    from kvstream.cli._endpoints import parse_source

    command = getattr(args, "command")
    if command == "subscribe":
        replays, names = getattr(args, "replay"), getattr(args, "name")
        for i, ep in enumerate(getattr(args, "endpoints")):
            parse_source(ep, replays[i] if i < len(replays) else None, names[i] if i < len(names) else None)
    elif command in ("record", "relay"):
        for ep in getattr(args, "endpoints", None) or getattr(args, "engines"):
            parse_source(ep)
    elif command == "serve":
        from kvstream.service.config import parse_engine

        for ep in getattr(args, "engines"):
            parse_engine(ep)
    elif command == "engine":
        from kvstream.cli.engine import build_config, events_config

        build_config(args)  # the cache size, planned from --model-config when given
        events_config(getattr(args, "kv_events_config"), getattr(args, "wire_version"))


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_every_documented_command_parses_as_written(cmd: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # paths in the docs are relative to the checkout
    if "--help" in cmd.argv or "-h" in cmd.argv:
        return
    args, warnings = _parse(cmd.argv)
    assert "deprecated" not in warnings, f"{cmd}: {warnings.strip()}"
    if cmd.shown_error is None:
        try:
            _check_endpoints(args)
        except Exception as exc:  # noqa: BLE001 - whatever the command would refuse it with
            raise AssertionError(f"{cmd}: the command would refuse it: {exc}") from None


def _runnable(cmd: Command) -> bool:
    argv = cmd.argv
    if not argv:
        return False
    if argv[0] in ("plan", "version"):
        return True
    if argv[0] in ("inspect", "convert"):
        return any(a.startswith("tests/data/") for a in argv)
    return False


RUNNABLE = [c for c in COMMANDS if _runnable(c)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder like a checkout (examples/ and tests/data/ at hand) that commands may write into."""
    d = tmp_path_factory.mktemp("doc_commands")
    (d / "tests").mkdir()
    os.symlink(REPO / "examples", d / "examples")
    os.symlink(REPO / "tests" / "data", d / "tests" / "data")
    return d


@pytest.mark.parametrize("cmd", RUNNABLE, ids=str)
def test_self_contained_commands_run_as_written(cmd: Command, workdir: Path) -> None:
    for out in workdir.glob("*.kvlog"):  # `convert` never overwrites
        out.unlink()
    r = subprocess.run([sys.executable, "-m", "kvstream", *cmd.argv], cwd=workdir, capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    if cmd.shown_error is not None:
        assert r.returncode != 0, f"{cmd}: the doc shows an error, the command succeeded"
        assert cmd.shown_error.split(": error: ", 1)[1][:40] in r.stderr, f"{cmd}: {r.stderr}"
    else:
        assert r.returncode == 0, f"{cmd}: exit {r.returncode}: {r.stderr.strip()}"
        assert "deprecated" not in r.stderr, f"{cmd}: {r.stderr.strip()}"


def test_untagged_blocks_hold_no_commands() -> None:
    bad = []
    for page, first, lang, body in _blocks():
        if lang:
            continue
        for k, line in enumerate(body.splitlines()):
            if re.match(r"\s*(\$ )?(kvstream|python -m kvstream|\.venv/bin/kvstream) ", line):
                bad.append(f"{page}:{first + k}: {line.strip()}")
    assert not bad, "tag these blocks bash/console (checked) or text (a synopsis):\n" + "\n".join(bad)


PYTHON = [(page, first, body) for page, first, lang, body in _blocks() if lang == "python"]


@pytest.mark.parametrize("page,first,body", PYTHON, ids=[f"{p}:{f}" for p, f, _ in PYTHON])
def test_python_blocks_compile_and_import_what_exists(page: str, first: int, body: str) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT | ast.PyCF_ONLY_AST
    try:
        tree = compile(body, f"{page}:{first}", "exec", flags=flags, dont_inherit=True)
    except SyntaxError as exc:
        raise AssertionError(f"{page}:{first + (exc.lineno or 1) - 1}: {exc.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvstream":
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{page}:{first + node.lineno - 1}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvstream":
                    importlib.import_module(alias.name)


def test_readme_python_snippets_say_they_are_fragments() -> None:
    readme = [(f, b) for p, f, b in PYTHON if p == "README.md"]
    assert readme
    for first, body in readme:
        assert body.lstrip().startswith("# A fragment"), f"README.md:{first}: say what the snippet leaves out"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    tests = [line for page, _, lang, body in _blocks() if page == "README.md" and lang in SHELL
             for line in body.splitlines()
             if "python -m pytest" in line and line.strip().startswith("python3 -m venv")]
    assert len(tests) == 1 and tests[0] in readme
    assert tests[0].strip() in [line.strip() for line in ci], ".ci/run must run the README's test command"


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_relative_links_between_pages_point_at_files_that_exist() -> None:
    pages = [*PAGES, *sorted((REPO / "bench" / "results").glob("*.md"))]
    bad = []
    for page in pages:
        text = _FENCE.sub("", page.read_text(encoding="utf-8"))  # not inside code blocks
        for m in _LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                bad.append(f"{page.relative_to(REPO)}: {target}")
    assert not bad, "\n".join(bad)
