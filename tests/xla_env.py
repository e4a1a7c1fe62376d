"""The XLA settings of the test run, for this process and the subprocesses tests start.

Tests compile many small programs and run each once or a few times, so most of their time is
compilation: the CPU backend's LLVM optimisation level 0 compiles faster (the HLO passes still run,
and the results are the same) and the suite takes ~30% less time. Benchmarks and
`python -m train` keep XLA's default."""

from __future__ import annotations

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def use_test_flags() -> None:
    """Add the test flags to XLA_FLAGS (before JAX starts its backend; subprocesses inherit them)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TEST_XLA_FLAGS not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()


def simulated_devices(count: int) -> dict[str, str]:
    """The environment of a subprocess that sees `count` simulated CPU devices (and the test flags)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
