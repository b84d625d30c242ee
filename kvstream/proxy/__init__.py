"""The KV-aware OpenAI-compatible proxy (see ``docs/proxy.md``).

* :mod:`kvstream.proxy.app`: :class:`~kvstream.proxy.app.KVProxy`, the ASGI app over a
  router (``kvstream serve --proxy`` mounts it; ``python -m kvstream.proxy`` is that command);
* :mod:`kvstream.proxy.core`: engines, in-flight load, mark-downs, routing accuracy (sans-IO);
* :mod:`kvstream.proxy.upstream`: kept-alive HTTP/1.1 connection pools to the engines;
* :mod:`kvstream.proxy.openai`: OpenAI request and error shapes (shared with the emulator);
* :mod:`kvstream.proxy.tokenize`: local tokenizers and chat templates.

Nothing is imported here, so ``import kvstream.proxy`` stays cheap.
"""
