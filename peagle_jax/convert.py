"""`python -m peagle_jax.convert` and the console script `peagle-convert`: the converter command
line (`peagle_jax.formats.convert`), its interrupt handlers installed before it loads JAX."""

import sys

from peagle_jax.runtime.command_line import exit_interrupted, terminate_as_interrupt


def main(argv=None) -> int:
    terminate_as_interrupt("interrupted")  # first: an interrupt while the converter imports ends the process too
    try:
        from peagle_jax.formats.convert import main as convert

        return convert(argv)
    except KeyboardInterrupt:  # landed before the converter's own frame
        exit_interrupted("interrupted")


if __name__ == "__main__":
    sys.exit(main())
