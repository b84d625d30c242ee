import sys

try:
    from kvstream.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python imports the command line: one line, as later
    print("kvstream: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
