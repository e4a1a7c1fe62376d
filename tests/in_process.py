"""A command line run inside the test process: `python -m MODULE ARGV` as its `main(argv)`, with
stdout and stderr captured, for tests that check what a command prints and leaves behind.

A subprocess pays the interpreter, JAX and transformers start-up again (~10 s of CPU each); in
the test process they are paid once per worker. Only what the process itself decides (a signal,
the interpreter's exit) needs a subprocess: tests/test_interrupts.py and the `-m` entry tests."""

from __future__ import annotations

import contextlib
import importlib
import io
import signal
import subprocess

# the command lines' modules: each has main(argv) -> exit status
MAINS = {
    "train": "train.__main__",
    "infer": "infer.__main__",
    "peagle_jax.convert": "peagle_jax.formats.convert",
    "peagle_jax.plan": "plan.__main__",
}


def run_module(module: str, argv) -> subprocess.CompletedProcess:
    """What `python -m module *argv` would give (exit status, stdout, stderr), run in this process.
    The SIGINT / SIGTERM handlers the command installs are put back afterwards."""
    main = importlib.import_module(MAINS[module]).main
    argv = [str(a) for a in argv]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # allowed, though every main returns its status
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess([module, *argv], int(code or 0), out.getvalue(), err.getvalue())
