"""The ``kvstream serve`` app for granian (bench/bench_granian.py): the same core, routes and
runtime as ``kvstream serve`` builds, as a plain ASGI app granian serves itself.

``KVSTREAM_BENCH_ENGINES``: the engines, space-separated, in serve's syntax;
``KVSTREAM_BENCH_PROXY=1``: the proxy mode's app (``serve --proxy``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from kvstream.service.app import create_app
from kvstream.service.config import build_config
from kvstream.service.core import ServiceCore

_cfg = build_config({"load_interval": 0.0}, os.environ["KVSTREAM_BENCH_ENGINES"].split(), None)
core = ServiceCore(_cfg)
_hot: Any = None
app: Any
if os.environ.get("KVSTREAM_BENCH_PROXY") == "1":
    from kvstream.proxy.app import KVProxy

    proxy = KVProxy.for_service(core)
    core.engine_view_extras.append(proxy.engine_view)
    _hot = create_app(core, extra_routes=proxy.openai_routes())
    inner = proxy.asgi(_hot)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # hold the proxy's pools for the app's life
            async with contextlib.AsyncExitStack() as stack:
                await stack.enter_async_context(proxy)
                await _hot(scope, receive, send)
            return
        await inner(scope, receive, send)
else:
    app = create_app(core)
