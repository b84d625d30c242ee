"""Import vLLM's allocator files unmodified, with our own stand-ins for the rest of vLLM.

:func:`load` puts a finder on ``sys.meta_path`` that serves every ``vllm.*`` module: the
few real files unpacked by :mod:`fetch` are executed as they are; any other module is a
stand-in whose unknown names are empty placeholder classes (the allocator files use most of
them only in annotations), plus the handful of functions and settings they call at run time
(a logger, ``cdiv``, the hash functions vLLM 0.11 keeps in its torch-importing ``utils``,
``envs`` defaults). No torch, no vLLM dependencies: only cbor2, msgspec and pyzmq, which
kvstream's own environment has.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import cbor2


class _Logger(logging.Logger):
    """vLLM's logger adds ``*_once`` methods; the peer logs nothing below WARNING."""

    def info_once(self, *args: Any, **kwargs: Any) -> None:
        pass

    def debug_once(self, *args: Any, **kwargs: Any) -> None:
        pass

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warning(msg, *args)


def _init_logger(name: str) -> logging.Logger:
    return _Logger(name, logging.WARNING)


def _cdiv(a: int, b: int) -> int:
    return -(a // -b)


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


# Settings vLLM reads from its environment module; anything else reads as None.
_ENVS = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": True}

# Explicit contents of stand-in modules (what the real files call at run time).
_STANDINS: dict[str, dict[str, Any]] = {
    "vllm.logger": {"init_logger": _init_logger},
    "vllm.utils": {"GiB_bytes": 1 << 30, "cdiv": _cdiv, "sha256": _sha256, "sha256_cbor": _sha256_cbor},
    "vllm.utils.math_utils": {"cdiv": _cdiv},
}


class _StandIn(types.ModuleType):
    """A vLLM module that is not there: unknown capitalised names are placeholder classes,
    unknown lower-case names stand-in submodules (never called by the allocator paths)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or (name[:1].islower() and self.__name__ != "vllm.envs"):
            # A lower-case name may be a submodule (``from vllm import envs``): Python
            # imports it through the finder below when the attribute is missing.
            raise AttributeError(name)
        if self.__name__ == "vllm.envs":
            value: Any = _ENVS.get(name)
        else:
            value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        real = self.root / (fullname.replace(".", "/") + ".py")
        if real.is_file() and fullname not in _STANDINS:
            return importlib.util.spec_from_file_location(fullname, real)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = _StandIn(spec.name)
        mod.__path__ = []  # every stand-in can have submodules
        mod.__dict__.update(_STANDINS.get(spec.name, {}))
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def load(root: Path) -> types.SimpleNamespace:
    """Import vLLM's real allocator modules from ``root`` (an unpacked release).

    Returns ``block_pool``, ``kv_cache_utils``, ``kv_events`` and ``hashing`` (vLLM 0.33's
    ``vllm.utils.hashing`` when the release has one, else the stand-in ``vllm.utils``).
    One release per process: the modules are registered under their real names.
    """
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        raise RuntimeError("a vLLM release is already loaded in this process")
    sys.meta_path.insert(0, _Finder(Path(root)))
    import importlib

    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    block_pool = importlib.import_module("vllm.v1.core.block_pool")
    if (Path(root) / "vllm/utils/hashing.py").is_file():
        hashing = importlib.import_module("vllm.utils.hashing")
    else:
        hashing = importlib.import_module("vllm.utils")
    return types.SimpleNamespace(block_pool=block_pool, kv_cache_utils=kv_cache_utils,
                                 kv_events=kv_events, hashing=hashing)
