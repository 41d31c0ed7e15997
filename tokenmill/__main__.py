"""`python -m tokenmill ...`: the `tokenmill` command line, for environments without the console script on PATH."""

import sys

from tokenmill.cli import main

if __name__ == "__main__":
    sys.exit(main())
