"""The XLA settings of the test run, for this process and the subprocesses tests start.

Tests compile many small programs and run each once or a few times, so most of their time is
compilation:
* the CPU backend's LLVM optimisation level 0 compiles faster (the HLO passes still run, and
  the results are the same): the suite takes ~25% less CPU time;
* one JAX compilation cache for the whole run (a temporary folder, removed at the end), shared
  by the xdist workers and every subprocess: the same program compiled again (the tiny preset's
  training step by several CLI runs, the reference runs) is read back instead.
Benchmarks and `python -m train` keep XLA's and JAX's defaults."""

from __future__ import annotations

import os
import shutil
import tempfile

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
CACHE_MIN_COMPILE_SECONDS = "0.2"  # JAX's default (1 s) would leave most of the tests' programs out
_created: list[str] = []


def configure() -> None:
    """The test flags and, unless one is set already (the xdist controller sets it for its
    workers), a fresh cache. Through the environment: JAX reads it at import, after conftest
    runs (nothing it imports loads JAX), and subprocesses inherit it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TEST_XLA_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        _created.append(tempfile.mkdtemp(prefix="peagle-jax-test-compile-cache-"))
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _created[-1]
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = CACHE_MIN_COMPILE_SECONDS


def remove_cache() -> None:
    """The cache folder, if this process made it."""
    while _created:
        shutil.rmtree(_created.pop(), ignore_errors=True)


def simulated_devices(count: int) -> dict[str, str]:
    """The environment of a subprocess that sees `count` simulated CPU devices (and the test settings)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
