"""`python -m peagle_jax.assets NAME`: the command that prepares a bundled real asset (the
assets themselves live in `peagle_jax.sources.assets`)."""

import sys

if __name__ == "__main__":
    from peagle_jax.sources.assets import main

    sys.exit(main())
