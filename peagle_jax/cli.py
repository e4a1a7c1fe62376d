"""What every command line of the project shares: one-line usage errors."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from collections.abc import Callable


class UsageError(Exception):
    """A command line that cannot be parsed (exit status 2)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors raise `UsageError` with one line (`PROG: message (see
    --help)`) instead of printing the whole usage block; subparsers inherit it."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def one_line(text) -> str:
    """A message folded onto one line (exception texts may hold newlines)."""
    return " ".join(str(text).split())


RETRY_S = 0.05  # an interrupt that arrived where Python drops (or converts) exceptions is raised again this late


def _drops_exceptions(frame) -> bool:
    """True when `frame` runs a gc callback (jax registers one) or a finaliser: an exception
    raised there is printed as "Exception ignored" and lost, and the interrupt with it; or when
    a module is being imported: raised inside an extension's initialisation it turns into an
    ImportError (a traceback, exit 1) instead of an interrupt."""
    if frame is None:
        return False
    if frame.f_code.co_name == "__del__" or any(frame.f_code is getattr(cb, "__code__", None) for cb in gc.callbacks):
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    if _drops_exceptions(frame):
        signal.signal(signal.SIGALRM, lambda _s, f: _interrupt(signum, f))
        signal.setitimer(signal.ITIMER_REAL, RETRY_S)  # deliver it once that code has returned
        return
    raise KeyboardInterrupt(f"interrupted by signal {signum}")


def terminate_as_interrupt() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so `finally` blocks run and a half-written
    folder is removed (the default SIGTERM kills the process on the spot). SIGINT is installed
    too because a process started with it ignored (a background job of a script) would not see it,
    and an interrupt arriving in a gc callback or finaliser, where Python drops exceptions, is
    raised again just after. Call it at the start of a CLI's work."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def exit_interrupted(message: str) -> None:
    """Print the interrupt's line and end the process now with status 130: the clean-up ran while
    the interrupt unwound, and the interpreter's own shutdown can crash while XLA threads are still
    compiling (a segmentation fault instead of 130)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every real default; flags (False) and unset options (None) stay quiet."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def run(
    argv, parse: Callable, work: Callable, *, failure_code: Callable = lambda args: 1, interrupted: str = "interrupted"
) -> int:
    """The shared frame of every CLI: parse (usage errors: one line, exit 2), then do the work
    with SIGTERM as an interrupt (exit 130, temporaries removed); any failure of the work is one
    `error: ...` line (the exception type named when it is not a ValueError / OSError / KeyError)
    and exit `failure_code(args)` (1; `inspect` says 2). PEAGLE_DEBUG=1 re-raises instead.
    `interrupted`: the line's text on an interrupt (what the user can do next)."""
    terminate_as_interrupt()  # before parsing: its imports take a second, an interrupt there is one too
    try:
        args = parse(argv)
    except UsageError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as err:  # --help
        return int(err.code or 0)
    except KeyboardInterrupt:
        exit_interrupted(interrupted)
    try:
        return int(work(args) or 0)
    except UsageError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        exit_interrupted(interrupted)
    except Exception as err:  # noqa: BLE001 - every failure is one line
        if os.environ.get("PEAGLE_DEBUG"):
            raise
        msg = one_line(err) or type(err).__name__
        known = isinstance(err, (ValueError, OSError, KeyError))
        print(f"error: {msg}" if known else f"error: {type(err).__name__}: {msg}", file=sys.stderr)
        return failure_code(args)
