"""`python tests/programs/killed_export.py HEAD OUT`: `python -m peagle_jax.convert export HEAD OUT
--format vllm` that sends itself SIGTERM once the files are written (just before their modes are
set), the way a scheduler stops a job; exits with the converter's status (130: interrupted)."""

import os
import signal
import sys

import peagle_jax.runtime.folders as folders
from peagle_jax.formats.convert import main as convert_main


def main(argv: list[str]) -> int:
    head, out = argv
    real = folders.apply_umask_modes

    def slow(root):  # the files are written: stop it like a scheduler would
        os.kill(os.getpid(), signal.SIGTERM)
        return real(root)

    folders.apply_umask_modes = slow
    return convert_main(["export", head, out, "--format", "vllm"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
