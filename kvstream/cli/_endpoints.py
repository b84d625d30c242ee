"""The one endpoint syntax every command accepts.

``[NAME=]PUB[,REPLAY]`` with optional ``,replay=ENDPOINT`` and ``,name=NAME`` options, e.g.
``e0=tcp://h:5557,tcp://h:5558`` or ``tcp://h:5557,replay=tcp://h:5558,name=e0``.
"""

from __future__ import annotations

from kvstream.transport import SourceSpec

__all__ = ["parse_source", "SYNTAX"]

SYNTAX = "[NAME=]PUB[,REPLAY] (or PUB,replay=REPLAY,name=NAME), e.g. e0=tcp://h:5557,tcp://h:5558"


def parse_source(text: str, replay: str | None = None, name: str | None = None) -> SourceSpec:
    """Parse one endpoint argument into a :class:`SourceSpec`; ``replay``/``name`` are
    defaults (from separate flags) that the text may override. Raises ``ValueError``
    saying what is wrong and the accepted syntax."""
    head, sep, rest = text.partition("://")
    if sep and "=" in head:
        name, text = text.split("=", 1)
    parts = text.split(",")
    pub, opts = parts[0], parts[1:]
    positional = 0
    for o in opts:
        key, eq, value = o.partition("=")
        if eq and "://" not in key:
            if key not in ("replay", "name") or not value:
                raise ValueError(f"bad option {o!r} in {text!r}; expected {SYNTAX}")
            if key == "replay":
                replay = value
            else:
                name = value
        elif "://" in o and positional == 0:
            replay, positional = o, 1
        else:
            raise ValueError(f"unexpected {o!r} in {text!r}; expected {SYNTAX}")
    if "://" not in pub:
        raise ValueError(f"{pub!r} is not an endpoint; write it as tcp://HOST:PORT (expected {SYNTAX})")
    if name == "":
        raise ValueError(f"empty source name in {text!r}")
    return SourceSpec(pub, replay or None, name or None)
