"""glibc malloc settings for the processes that are all perseus-ext's (its executable, its
background solver).

The solver makes and drops many temporary arrays of a few MiB ((computations x deadlines)
floats and indices). By default glibc hands freed memory at the top of its heap back to the
kernel, and serves large allocations from fresh mappings, so the next array of that size
faults its pages in again: at 8 stages x 24 microbatches that was ~13,000 page faults and
4-7 % of the wall time of `perseus-ext frontier` (benchmarks/command_ab.py). Keeping up to
16 MiB of freed memory for reuse raises the peak a little (16 x 128: 254 -> 265 MiB; keeping
256 MiB would cost 334 MiB for no more speed at 8 x 24).

Only those processes call `keep_freed_memory`: a training process keeps its allocator as its
user set it up.
"""

from __future__ import annotations

import ctypes

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Free heap top kept before trimming, and the size from which an allocation gets its own
# mapping (32 MiB is the largest glibc accepts on 64-bit; larger arrays are mapped as before).
TRIM_THRESHOLD_BYTES = 16 * 2**20
MMAP_THRESHOLD_BYTES = 32 * 2**20


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse; False where the C library has no `mallopt`
    (macOS, Windows) or refuses the settings (the defaults then stay)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either one ends glibc's own adjustment of the other.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
