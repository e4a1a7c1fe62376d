"""`python tests/programs/sigterm_write.py OUT`: starts writing the folder OUT through
`atomic_folder` (with `terminate_as_interrupt` installed), sends itself SIGTERM halfway through
and exits 130 once the interrupt has unwound the write (which must leave no temporary behind)."""

import os
import signal
import sys
import time

from peagle_jax.runtime.command_line import terminate_as_interrupt
from peagle_jax.runtime.folders import atomic_folder


def main(argv: list[str]) -> int:
    terminate_as_interrupt()
    try:
        with atomic_folder(argv[0]) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
