"""The command line a script records in its results, as a user types it: `python -m bench.NAME ARGS`
(under `python -m`, sys.argv[0] is the script's full path on this machine, not what was typed)."""

from __future__ import annotations

import shlex
import sys


def command_line(module: str, argv: list[str] | None = None) -> str:
    """`python -m MODULE ARGS`, ARGS this process's arguments unless `argv` is given."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])
