"""`python -m report` (see `report.cli`)."""

import sys

from report.cli import main

if __name__ == "__main__":
    sys.exit(main())
