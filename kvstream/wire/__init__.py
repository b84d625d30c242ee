"""The wire: vLLM's KV event schema and codec (``events``), ZMQ frame shapes (``framing``) and
the golden capture file format (``capture``).

Everything that knows how bytes look on vLLM's sockets lives in this package; it imports
nothing of kvstream but :mod:`kvstream.errors`.
"""

from __future__ import annotations

from kvstream.wire import capture, events, framing
from kvstream.wire.capture import *  # noqa: F403 - the package re-exports each module's __all__
from kvstream.wire.events import *  # noqa: F403
from kvstream.wire.framing import *  # noqa: F403

__all__ = [*events.__all__, *framing.__all__, *capture.__all__]
