"""The XLA settings of the test run, for this process and the subprocesses tests start.

Tests compile many small programs and run each once or a few times, so most of their time is
compilation:
* the CPU backend's LLVM optimisation level 0 compiles faster (the HLO passes still run, and
  the results are the same): the suite takes ~25% less CPU time;
* one JAX compilation cache, shared by the xdist workers and every subprocess, and kept between
  runs in `~/.cache/peagle_jax/test-compile-cache` (LRU, at most 2 GiB): the same program compiled
  again (the tiny preset's training step by several CLI runs, the reference runs, and every
  program a change left alone since the last run) is read back instead. Every program is kept,
  however fast it compiled: a test that runs ops eagerly compiles one small program per op and
  shape (hundreds in a gradient check), and reading them back is several times faster (on
  tests/test_drafter.py, warm: 47 s against 181 s when only programs over 0.2 s were kept). JAX
  keys an entry by the program's HLO, the compile options and the jax / jaxlib versions, so an
  edited program is compiled afresh. A run after the first on a machine takes about a third of the
  first one's CPU time; `JAX_COMPILATION_CACHE_DIR=$(mktemp -d) make test` measures a cold run.
Benchmarks and `python -m train` keep XLA's and JAX's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from limits import HANG_S

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
CACHE_MIN_COMPILE_SECONDS = "0"  # every program: the tests' eager ops compile one small program each
CACHE_MAX_BYTES = str(2 << 30)


def cache_folder() -> Path:
    """Where the suite's compilation cache lives between runs (beside the prepared assets)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "peagle_jax" / "test-compile-cache"


def configure() -> None:
    """The test flags and, unless one is set already (the xdist controller sets it for its
    workers; a user may name a fresh folder for a cold run), the suite's cache. Through the
    environment: JAX reads it at import, after conftest runs (nothing it imports loads JAX), and
    subprocesses inherit it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TEST_XLA_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        cache_folder().mkdir(parents=True, exist_ok=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache_folder())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", CACHE_MIN_COMPILE_SECONDS)
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", CACHE_MAX_BYTES)


def simulated_devices(count: int) -> dict[str, str]:
    """The environment of a subprocess that sees `count` simulated CPU devices (and the test settings)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def run_program(program, *args, devices: int) -> dict:
    """The JSON of the last line `program args` prints, run on `devices` simulated CPU devices (a
    subprocess: the device count is fixed when JAX starts); a failed run fails with its stderr."""
    root = Path(__file__).resolve().parents[1]
    env = {**simulated_devices(devices), "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    cmd = [sys.executable, *map(str, (program, *args))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
