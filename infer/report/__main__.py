"""`python -m infer.report` runs `python -m report` (its earlier name, which the docs used)."""

import sys

from report.cli import main

if __name__ == "__main__":
    sys.exit(main())
