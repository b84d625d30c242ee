import sys

from kvstream.cli import main

sys.exit(main())
