"""The router index as it was at an earlier commit, loaded from this checkout's git history.

``bench_index.py`` measures the current index beside the previous layout in the same
process. Rather than keep a second copy of that code in the tree, the reference is read from
git (``git show COMMIT:kvstream/routing/...``) into a cache folder outside the repository and
imported from there as the package ``reference_index``; only its imports of its own
siblings are made relative. Needs a git checkout with that commit in its history.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REFERENCE_COMMIT = "ac81aa3"
"""The last pure-Python index: ``engine hash -> key`` and ``key -> source mask`` dicts
(``table="dict"``, then the default) and their ingest loops, before the native table."""

_FILES = ("index", "_core", "table", "keying")


def load_reference_index(commit: str = REFERENCE_COMMIT) -> ModuleType:
    """Import the index of ``commit`` as ``reference_index`` (its ``KVIndex`` is the reference)."""
    repo = Path(__file__).resolve().parents[1]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvstream" / f"reference-index-{commit}"
    pkg = cache / "reference_index"
    if not (pkg / "__init__.py").exists():
        pkg.mkdir(parents=True, exist_ok=True)
        for name in _FILES:
            try:
                src = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:kvstream/routing/{name}.py"],
                                     check=True, capture_output=True, text=True).stdout
            except (OSError, subprocess.CalledProcessError) as exc:
                raise SystemExit(f"bench: cannot read the reference index from git commit {commit} "
                                 f"({exc}); run from a git checkout of kvstream with its history") from exc
            for sib in _FILES:
                src = src.replace(f"from kvstream.routing.{sib} import", f"from .{sib} import")
            (pkg / f"{name}.py").write_text(src)
        (pkg / "__init__.py").write_text(f'"""kvstream\'s router index at commit {commit} (bench reference)."""\n'
                                         "from .index import KVIndex\n")
    sys.path.insert(0, str(cache))
    return importlib.import_module("reference_index")
