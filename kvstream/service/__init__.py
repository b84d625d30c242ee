"""``kvstream serve``: the router as a network service (HTTP/JSON).

Layers, top to bottom: :mod:`.app` (Starlette routes, lifespan) -> :mod:`.core` (the sans-IO
service core: engines, indexes, handlers) with :mod:`.mooncake` (the Mooncake indexer
API) -> :mod:`.runtime` (the async shell: subscriber pump, load scraper). Configuration in
:mod:`.config`; documents in :mod:`.schema`; load sources in :mod:`.load`.
Nothing in kvstream imports this package.
"""

from kvstream.service.config import EngineSpec, ServeConfig
from kvstream.service.core import ServiceCore
from kvstream.service.errors import ApiError, ConfigError

__all__ = ["ServeConfig", "EngineSpec", "ServiceCore", "ApiError", "ConfigError"]

