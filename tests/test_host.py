"""`peagle_jax.runtime.host`: with `reuse_freed_memory` a large block freed and allocated again reuses
its pages (no page faults), where glibc's default maps it afresh every time; every command runs
with the garbage collector's passes spaced as `collect_less_often` sets them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from limits import HANG_S

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "page_faults.py"


def faults_per_allocation(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, str(PROGRAM), mode],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    assert faults_per_allocation("default") > pages // 2  # glibc maps a block this large afresh
    assert faults_per_allocation("reuse") < pages // 50


def test_a_command_runs_with_the_collector_spaced_for_tracing():
    """Checked in a fresh interpreter (Python's defaults, 700 / 10 / 10), through the commands'
    shared frame: the work sees `GC_THRESHOLDS`, and its reference cycles are still collected."""
    code = (
        "import gc, sys\n"
        "from peagle_jax.runtime.command_line import run\n"
        "print(gc.get_threshold())\n"
        "def work(args):\n"
        "    cycle = []; cycle.append(cycle); del cycle\n"
        "    print(gc.get_threshold(), gc.collect() >= 1)\n"
        "    return 0\n"
        "sys.exit(run([], lambda argv: argv, work))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=HANG_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    from peagle_jax.runtime.host import GC_THRESHOLDS

    assert out.stdout.splitlines() == ["(700, 10, 10)", f"{GC_THRESHOLDS} True"]
