"""kvstream as a package: ``python -m build`` makes an sdist and a wheel (the wheel built
from the sdist, so the sdist is complete), the wheel carries the license and metadata, and
installed into a fresh venv it runs ``kvstream --version`` and ``kvstream demo --quick``.

Offline: the build runs without isolation (maturin and build come from the test
extra), and the fresh venv gets the wheel with ``--no-deps``; the dependencies are made
visible to it from this environment through a path file, not installed from an index.
Marked ``slow`` (about 10 s): deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _copy_source(dst: Path) -> Path:
    src = dst / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis",
        ".mypy_cache", "kvstream-demo", "*.kvlog", "venv", "target", "*.so"))
    return src


def test_sdist_and_wheel_build_install_in_a_fresh_venv_and_run_the_demo(tmp_path):
    pytest.importorskip("build")
    src = _copy_source(tmp_path)
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sdists = list(dist.glob("kvstream-*.tar.gz"))
    wheels = list(dist.glob("kvstream-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1

    with zipfile.ZipFile(wheels[0]) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "kvstream/py.typed" in names and "kvstream/cli/__init__.py" in names
    assert "kvstream/service/ui/index.html" in names  # the status page, package data
    assert any(n.startswith("kvstream/_native") for n in names)  # the native core, built from the sdist
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta
    assert "Classifier: Typing :: Typed" in meta and "Keywords:" in meta

    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                        "--quiet", str(wheels[0])], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # The dependencies (anyio, msgspec, pyzmq, ...) from this environment, offline.
    (site / "_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "run"
    work.mkdir()
    kv = env_dir / "bin" / "kvstream"
    where = subprocess.run([str(py), "-c", "import kvstream; print(kvstream.__file__)"],
                           capture_output=True, text=True, cwd=work, timeout=60)
    assert where.stdout.startswith(str(env_dir)), where  # the installed wheel, not this checkout
    r = subprocess.run([str(py), "-c", "import kvstream._native"], capture_output=True, text=True, cwd=work,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(kv), "--version"], capture_output=True, text=True, cwd=work, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kvstream 0.") and "pyzmq" in r.stdout, r
    r = subprocess.run([str(kv), "demo", "--quick", "--out", str(work / "demo")], capture_output=True, text=True,
                       cwd=work, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
