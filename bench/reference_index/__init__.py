"""The router index as it was before the one-residency-index redesign (kvstream commit
49446cb, dict layout: ``engine hash -> key`` and ``key -> source mask`` dicts), kept
unmodified as the same-process reference of ``bench/bench_index.py``. Not used by
kvstream itself."""

from .index import KVIndex

__all__ = ["KVIndex"]
