"""The import contract of docs/architecture.md, checked over the package's own source.

Data flows one way (allocator -> wire -> transport -> routing) and imports follow it. Each
layer lists the layers of ours it may import; a sans-IO core may not import a socket
library. A new top-level module or folder must be given a row here (the last test fails
until it is), so the rules cannot be bypassed by adding a layer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "kvstream"

_BASE = {"errors", "compat"}
# layer -> layers of ours it may import (itself always allowed). "*" = anything but the CLI.
ALLOWED: dict[str, set[str] | str] = {
    "errors": set(),
    "compat": {"errors", "hashing", "wire"},  # factory methods only; data at import time
    "hashing": _BASE,
    "wire": _BASE,
    "allocator": _BASE | {"hashing", "wire"},
    "transport": _BASE | {"wire"},
    "routing": _BASE | {"hashing", "wire", "transport", "_native"},  # _native: the Rust core (imports nothing of ours)
    "eventlog": _BASE | {"wire", "transport", "routing"},
    "planning": _BASE,
    "observe": _BASE | {"wire", "transport", "routing"},
    "sim": _BASE | {"hashing", "wire", "allocator", "routing", "planning"},
    "jetstream": _BASE | {"hashing", "wire", "transport", "routing", "observe", "eventlog"},
    "service": _BASE | {"hashing", "wire", "transport", "routing", "observe", "eventlog", "jetstream", "_native"},
    "proxy": _BASE | {"hashing", "wire", "transport", "routing", "observe", "service"},
    "gateway": _BASE | {"hashing", "wire", "transport", "routing", "observe", "service", "proxy"},
    "emulator": "*",  # a whole engine and the demo's stack: everything but the CLI
    "cli": "*",
    "__init__": "*",  # the facade: lazy, checked by test_facade_imports_nothing
    "__main__": {"cli"},
}

SOCKET_LIBS = {"zmq", "socket", "nats", "httpx", "uvicorn", "starlette", "anyio", "asyncio", "selectors"}
# Modules of a sans-IO layer that are its async shell (they may use an event loop and sockets).
SHELLS = {
    "allocator/shell.py": {"anyio"},
    "routing/router.py": {"anyio", "zmq"},
}
SANS_IO = {"hashing", "wire", "allocator", "routing", "planning", "errors", "compat"}


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                for n in ast.walk(sub):
                    skip.add(id(n))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_module_imports_only_the_layers_below_it(path: Path) -> None:
    layer = _layer(path)
    rule = ALLOWED.get(layer)
    assert rule is not None, f"{path.relative_to(PKG)}: layer {layer!r} has no row in ALLOWED"
    rel = str(path.relative_to(PKG))
    # Entry points run the CLI: ``python -m kvstream`` and ``python -m kvstream.proxy``
    # (which is ``kvstream serve --proxy``) and nothing else.
    entry = {"cli"} if rel == "proxy/__main__.py" else None
    for line, mod in _imports(path):
        parts = mod.split(".")
        if parts[0] == "kvstream" and len(parts) > 1:
            target = parts[1]
            if target == layer:
                continue
            if entry is not None:
                assert target in entry, f"{rel}:{line}: an entry point imports only the CLI, not {mod!r}"
                continue
            assert target != "cli" or layer in ("cli", "__main__"), f"{rel}:{line} imports the CLI ({mod})"
            if rule == "*":
                continue
            assert target in rule, f"{rel}:{line}: layer {layer!r} may not import {mod!r} (allowed: {sorted(rule)})"
        elif layer in SANS_IO and parts[0] in SOCKET_LIBS:
            assert parts[0] in SHELLS.get(rel, set()), f"{rel}:{line}: sans-IO layer {layer!r} imports {mod!r}"


def test_router_index_never_imports_the_allocator() -> None:
    for path in (PKG / "routing").rglob("*.py"):
        assert not any(m.startswith("kvstream.allocator") for _, m in _imports(path)), path


def test_facade_imports_nothing() -> None:
    """``import kvstream`` loads no layer and no socket library; a name loads only its home."""
    code = (
        "import sys, kvstream\n"
        "mods = sorted(m for m in sys.modules if m.startswith(('kvstream', 'zmq', 'anyio')))\n"
        "assert mods == ['kvstream'], mods\n"
        "from kvstream import BlockPool\n"
        "bad = [m for m in sys.modules if m.startswith(('zmq', 'anyio', 'kvstream.transport', 'kvstream.sim'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_facade_table_matches_its_typing_imports() -> None:
    import kvstream

    tree = ast.parse((PKG / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                if isinstance(sub, ast.ImportFrom) and sub.module:
                    typed.update({a.name: sub.module for a in sub.names})
    assert typed == kvstream._HOME
    for name in kvstream._HOME:
        assert getattr(kvstream, name) is not None


def test_every_layer_has_a_rule() -> None:
    layers = {_layer(p) for p in _modules()}
    assert layers <= set(ALLOWED), sorted(layers - set(ALLOWED))
