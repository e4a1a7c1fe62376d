"""What every command line of the project shares: one-line usage errors."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from peagle_jax.runtime.host import collect_less_often

T = TypeVar("T")


class UsageError(Exception):
    """A command line that cannot be parsed (exit status 2)."""


def number_type(kind, lo, hi, what: str):
    """An argparse type: `kind(text)` within [lo, hi] (nan and inf never pass)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = number_type(int, 1, float("inf"), "a positive integer")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors raise `UsageError` with one line (`PROG: message (see
    --help)`) instead of printing the whole usage block; subparsers inherit it."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def one_line(text) -> str:
    """A message folded onto one line (exception texts may hold newlines)."""
    return " ".join(str(text).split())


RETRY_S = 0.05  # an interrupt that arrived where Python drops (or converts) exceptions is raised again this late
RECHECK_S = 0.5  # after an interrupt was raised: how often the process checks it was not swallowed on its way up

_received: list[int] = []  # the interrupting signal (SIGINT / SIGTERM) once one came: the process is ending
_deferring: list[bool] = []  # non-empty while `signals_deferred` holds (a clean-up that must finish)
_starting: list[str] = []  # while the command starts (nothing written yet): the line an interrupt ends it with
_phase = threading.RLock()  # start-up ends (`started`) or the process ends in it, never both halfway
_watching: list[int] = []  # the read end of the wakeup pipe, once `_watch_signals` started its thread


def _in_weakref_callback(frame) -> bool:
    """A `weakref.finalize` callback (or one of a plain weakref): Python prints what it raises as
    "Exception ignored in ..." and goes on."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith("weakref.py") and code.co_name in ("__call__", "_exitfunc"):
            return True
        frame = frame.f_back
    return False


def _drops_exceptions(frame) -> bool:
    """True when `frame` runs a gc callback (jax registers one), a finaliser (`__del__`, a
    `weakref.finalize` callback): an exception raised there is printed as "Exception ignored"
    and lost, and the interrupt with it; or when a module is being imported: raised inside an
    extension's initialisation it turns into an ImportError (a traceback, exit 1) instead of an
    interrupt."""
    if frame is None:
        return False
    if frame.f_code.co_name == "__del__" or any(frame.f_code is getattr(cb, "__code__", None) for cb in gc.callbacks):
        return True
    if _in_weakref_callback(frame):
        return True
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _unwinding(exc) -> bool:
    """The exception being handled is the interrupt (finally blocks, `with` exits and clean-ups run
    while it travels up), or one that an interrupt turned into (its cause or context)."""
    seen = 0
    while exc is not None and seen < 32:
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _arm(seconds: float) -> None:
    signal.signal(signal.SIGALRM, _recheck)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _recheck(_signum, frame):
    """The timer an interrupt arms: while the process lives on, the interrupt is either on its way
    up (leave it: the clean-ups it runs finish), or landed where Python can't raise it yet (try
    again soon), or was swallowed (a library's bare `except`, a callback that printed and dropped
    it): raised again, so the process ends within about RECHECK_S of the signal."""
    if not _received:
        return
    _end_if_starting()
    if _deferring or _drops_exceptions(frame):
        _arm(RETRY_S)
        return
    _arm(RECHECK_S)
    if not _unwinding(sys.exc_info()[1]):
        raise KeyboardInterrupt(f"interrupted by signal {_received[0]}")


def _end_if_starting() -> None:
    """During start-up there is nothing to save or remove: the process ends at once, wherever the
    signal landed (an import, a gc callback: where an exception would wait for the code to return)."""
    with _phase:
        if _starting and not _deferring:
            exit_interrupted(_starting[0])


def _watch(fd: int) -> None:
    """Reads the signals' bytes (`signal.set_wakeup_fd`) on a thread: Python runs a handler only
    once the main thread is back in Python code, and start-up spends up to seconds in native calls
    (a shared library's loading, the backend's start); in start-up this thread ends the process."""
    while True:
        try:
            got = os.read(fd, 64)
        except OSError:
            return
        if not got:
            return
        if signal.SIGINT in got or signal.SIGTERM in got:
            _end_if_starting()


def _watch_signals() -> None:
    if _watching or threading.current_thread() is not threading.main_thread():
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read,), name="interrupt-watch", daemon=True).start()
    _watching.append(read)


def _interrupt(signum, frame):
    if not _received:
        _received.append(signum)
    _end_if_starting()
    if _deferring or _drops_exceptions(frame):
        _arm(RETRY_S)  # raised once that code has returned
        return
    _arm(RECHECK_S)  # the one path for the rest of the process's life: raised again if swallowed
    raise KeyboardInterrupt(f"interrupted by signal {signum}")


def terminate_as_interrupt(starting: str | None = None) -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so `finally` blocks run and a half-written
    folder is removed (the default SIGTERM kills the process on the spot). SIGINT is installed
    too because a process started with it ignored (a background job of a script) would not see it.
    The signal is recorded (`interrupted`), and one that arrives where Python drops exceptions (a
    gc callback, a finaliser, a weakref callback) or that some code swallows on its way up is
    raised again just after (a timer, `_recheck`); `run` turns a recorded signal into exit 130
    whatever the work returned. Call it at the start of a CLI's work. `starting`: the command
    starts now (`starting_up`)."""
    if starting is not None:
        starting_up(starting)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)  # last: a caught SIGTERM says both are installed
    if starting is not None:
        _watch_signals()


def starting_up(line: str) -> None:
    """The command is starting (imports, parsing, reading: nothing written yet): until `started`,
    an interrupt prints `line` and ends the process at once (exit 130) instead of unwinding, which
    waits for an import or a native call to return (seconds at start-up)."""
    _starting[:] = [line]


def started() -> None:
    """The command begins to write (a folder, a file): from here an interrupt unwinds, so the
    clean-ups on its way up run (a temporary removed, a checkpoint kept). The project's writers
    (`peagle_jax.runtime.folders`) call it; a no-op outside a command's start-up (the Python API)."""
    with _phase:
        _starting.clear()


def interrupted() -> int | None:
    """The signal that interrupted this process, None when none came."""
    return _received[0] if _received else None


def check_interrupted() -> None:
    """KeyboardInterrupt when a signal came and the work is still going (it was swallowed on its
    way up): call it between phases of the work."""
    if _received and not _deferring:
        raise KeyboardInterrupt(f"interrupted by signal {_received[0]}")


def interruptible(fn: Callable[[], T]) -> T:
    """`fn()` on a worker thread while this one waits for it: an interrupt ends the wait at once
    even when `fn` sits for minutes in native code that Python cannot stop (an XLA compile), where
    the handler would only run once it returned. The abandoned worker is a daemon thread: `run`
    ends the process with os._exit, the interpreter's shutdown does not wait for it."""
    done: dict = {}

    def work():
        try:
            done["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            done["error"] = err

    worker = threading.Thread(target=work, name="interruptible", daemon=True)
    worker.start()
    worker.join()  # a lock wait: a signal's handler runs in it (and raises the interrupt)
    if "error" in done:
        raise done["error"]
    return done["value"]


@contextlib.contextmanager
def signals_deferred():
    """An interrupt during the block (a clean-up that must not stop halfway) is raised after it
    (by the timer it arms, `_recheck`: unless the interrupt is the exception being handled)."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()


def note(err: BaseException, text: str) -> BaseException:
    """`err` with a note `run` adds to its one line (for an interrupt: the line itself)."""
    with contextlib.suppress(AttributeError, TypeError):
        err.cli_note = text
    return err


def _note_of(err: BaseException | None) -> str | None:
    """The note of `err` or of the exception it was raised while handling (an interrupt raised
    again during the clean-up of the error it had turned into)."""
    seen = 0
    while err is not None and seen < 32:
        if getattr(err, "cli_note", None):
            return err.cli_note
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _stdout_gone() -> int:
    """stdout's reader went away (`python -m train --help | head -3`): nothing more to say, and the
    interpreter's last flush must not complain either. The status of a process ended by SIGPIPE."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _flush_stdout() -> None:
    sys.stdout.flush()


def _close_progress_bars() -> None:
    """tqdm's open bars closed, as unwinding would have: each ends its line, so the interrupt's
    line starts one of its own."""
    bars = getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", None)
    for bar in list(bars or ()):
        with contextlib.suppress(Exception):
            bar.close()


def exit_interrupted(message: str) -> None:
    """Print the interrupt's line and end the process now with status 130: the clean-up ran while
    the interrupt unwound, and the interpreter's own shutdown can crash while XLA threads are still
    compiling (a segmentation fault instead of 130)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    _close_progress_bars()
    with contextlib.suppress(Exception):  # the process's own stderr: a block may redirect sys.stderr (tyro's parse)
        print(f"error: {message}", file=sys.__stderr__ or sys.stderr, flush=True)
    os._exit(130)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every real default; flags (False) and unset options (None) stay quiet."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def run(
    argv,
    parse: Callable,
    work: Callable,
    *,
    failure_code: Callable = lambda args: 1,
    interrupted: str = "interrupted",
    starting: str | None = None,
) -> int:
    """The shared frame of every CLI: parse (usage errors: one line, exit 2), then do the work
    with SIGTERM as an interrupt (exit 130, temporaries removed); any failure of the work is one
    `error: ...` line (the exception type named when it is not a ValueError / OSError / KeyError;
    a note the work added with `note` in parentheses after it) and exit `failure_code(args)` (1;
    `inspect` says 2). PEAGLE_DEBUG=1 re-raises instead. `interrupted`: the line's text on an
    interrupt (what the user can do next; a note on the interrupt replaces it). A signal that came
    is exit 130 whatever the work did with it (swallowed, converted, or returned anyway). A reader
    of stdout that went away (`| head`) ends the command quietly (status 141). The parse is
    start-up (`starting_up`: an interrupt ends the process at once); with `starting` (the line
    then), so is the work until it first writes (`started`): for a work whose interrupt has nothing
    to clean up before that (no child process to stop, no `finally` that must run)."""
    terminate_as_interrupt(starting or interrupted)  # before parsing: its imports take seconds
    collect_less_often()  # every command traces programs (peagle_jax.runtime.host)
    try:
        return _run(argv, parse, work, failure_code, interrupted, starting is not None)
    finally:
        started()  # a command run in process (tests, the Python API) leaves no start-up behind


def _run(argv, parse: Callable, work: Callable, failure_code: Callable, interrupted: str, work_starts: bool) -> int:
    try:
        args = parse(argv)
    except UsageError as err:
        if _received:  # an interrupt a parser's check turned into its own error
            exit_interrupted(interrupted)
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as err:  # --help
        try:
            _flush_stdout()
        except BrokenPipeError:
            return _stdout_gone()
        return int(err.code or 0)
    except BrokenPipeError:
        return _stdout_gone()
    except KeyboardInterrupt as err:
        exit_interrupted(_note_of(err) or interrupted)
    if not work_starts:
        started()
    try:
        code = int(work(args) or 0)
        _flush_stdout()
    except UsageError as err:
        if _received:
            exit_interrupted(interrupted)
        print(f"error: {_with_note(one_line(err), err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        exit_interrupted(_note_of(err) or interrupted)
    except BrokenPipeError:
        return _stdout_gone()
    except Exception as err:  # noqa: BLE001 - every failure is one line
        if _received:  # an interrupt some code turned into another exception on its way up
            exit_interrupted(_note_of(err) or interrupted)
        if os.environ.get("PEAGLE_DEBUG"):
            raise
        msg = one_line(err) or type(err).__name__
        known = isinstance(err, (ValueError, OSError, KeyError))
        msg = _with_note(msg if known else f"{type(err).__name__}: {msg}", err)
        print(f"error: {msg}", file=sys.stderr)
        return failure_code(args)
    if _received:  # a signal the work swallowed: still an interrupted run
        exit_interrupted(interrupted)
    return code


def _with_note(msg: str, err: BaseException) -> str:
    extra = getattr(err, "cli_note", None)
    return f"{msg} ({one_line(extra)})" if extra else msg
