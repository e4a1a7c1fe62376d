"""`python tests/programs/page_faults.py MODE`: allocates, fills and frees a 64 MB block four
times (what an XLA call does with its temporaries) and prints the most minor page faults any
allocation after the first took. MODE `reuse` calls `peagle_jax.runtime.host.reuse_freed_memory` first;
`default` keeps glibc's allocator settings."""

import ctypes
import ctypes.util
import resource
import sys

from peagle_jax.runtime.host import reuse_freed_memory


def main(argv: list[str]) -> int:
    if argv[0] == "reuse":
        assert reuse_freed_memory()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 64 << 20, []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(max(faults[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
