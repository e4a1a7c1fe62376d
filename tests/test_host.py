"""`peagle_jax.host.reuse_freed_memory`: a large block freed and allocated again reuses its pages
(no page faults), where glibc's default maps it afresh every time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, ctypes.util, resource, sys
    from peagle_jax.host import reuse_freed_memory

    if sys.argv[1] == "reuse":
        assert reuse_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 64 << 20, []
    for _ in range(4):  # a 64 MB buffer filled and freed: what an XLA call does with its temporaries
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(max(faults[1:]))
""")


def faults_per_allocation(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    assert faults_per_allocation("default") > pages // 2  # glibc maps a block this large afresh
    assert faults_per_allocation("reuse") < pages // 50
