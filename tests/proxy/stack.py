"""Real processes for the proxy's tests: engines and a ``serve --proxy`` in front of them."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from kvstream.emulator.launch import Proc, start_engine, start_serve_proxy


@contextlib.contextmanager
def engines_and_proxy(logs: str, engine_opts: Sequence[str], proxy_extra: Sequence[str] = (), *,
                      n: int = 2, prefix: str = "e") -> Iterator[tuple[Proc, list[Proc]]]:
    """``n`` ``kvstream engine``s (started in parallel) and ``kvstream serve --proxy``
    following them; everything is stopped on the way out."""
    engines = [start_engine(f"{prefix}{i}", extra=list(engine_opts), log_dir=logs, wait=False) for i in range(n)]
    try:
        for e in engines:
            e.wait_ready(60)
        with start_serve_proxy(engines, log_dir=logs, extra=list(proxy_extra)) as proxy:
            yield proxy, engines
    finally:
        for e in engines:
            e.stop()
