"""`peagle_jax.runtime.host.reuse_freed_memory`: a large block freed and allocated again reuses its pages
(no page faults), where glibc's default maps it afresh every time."""

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
