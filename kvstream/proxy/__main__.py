"""``python -m kvstream.proxy``: exactly ``kvstream serve --proxy``, with the same syntax.

    python -m kvstream.proxy e0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558,http=http://127.0.0.1:8000 \\
        e1=tcp://127.0.0.1:5567,tcp://127.0.0.1:5568,http=http://127.0.0.1:8001 --port 9000

is ``kvstream serve --proxy`` with those arguments (see ``kvstream serve --help`` and
docs/proxy.md): one proxy, one set of flags, one ``/v1/engines``.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvstream serve --proxy ARGV...``; returns the exit code."""
    from kvstream.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["serve", "--proxy", *(a for a in args if a != "--proxy")])


if __name__ == "__main__":
    sys.exit(main())
