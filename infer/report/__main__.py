"""`python -m infer.report` (see `infer.report.cli`)."""

import sys

from infer.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
