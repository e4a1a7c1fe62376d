"""`python -m peagle_jax.plan`: the plan command under the name it first had. The command is the
top-level `plan` package (it builds the trainer's step, so it sits above `train/`)."""

import sys

from plan.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
