"""`python -m peagle_jax.convert`: the converter command line (`peagle_jax.formats.convert`)."""

import sys

from peagle_jax.formats.convert import main

if __name__ == "__main__":
    sys.exit(main())
