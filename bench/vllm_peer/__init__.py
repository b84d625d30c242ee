"""Peer benchmark: kvstream against vLLM's own allocator code, fetched on demand (not part of CI).

See ``bench/README.md``. ``fetch`` downloads and unpacks a vLLM wheel into a cache directory
outside the repository, ``shims`` imports vLLM's ``block_pool.py``, ``kv_cache_utils.py`` and
``kv_events.py`` unmodified with stand-ins for what they import of the rest of vLLM,
``workloads`` holds the traces and the drivers, and ``run`` runs the contenders interleaved,
each in its own process.
"""
