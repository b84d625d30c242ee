"""The emulated vLLM engine, ``kvstream engine`` (see ``docs/emulator.md``).

* :mod:`kvstream.emulator.core`: :class:`~kvstream.emulator.core.EmulatedEngine`, the sans-IO
  engine over the simulator's engine model and kvstream's allocator;
* :mod:`kvstream.emulator.server`: its HTTP server, event publisher and step loop;
* :mod:`kvstream.emulator.launch`: start engines and proxies as processes, wait for ready;
* :mod:`kvstream.emulator.loadgen`: a multi-turn chat load generator over HTTP;
* :mod:`kvstream.emulator.demo`: the ``kvstream demo`` stack.
"""
