"""Process settings that CPU serving needs, applied before the work starts.

Two defaults of a stock CPU process cost more than the model on small and medium batches:

- OpenMP threads that spin-wait between parallel regions (libgomp's default). On a machine
  where another process holds a core, every op then waits a scheduler time slice for its
  descheduled partner thread while the spinning one burns the core it needs: tiny ops go
  from ~40 us to ~8 ms. `OMP_WAIT_POLICY=PASSIVE` makes idle threads sleep instead. libgomp
  reads it when it loads, so `spin_policy()` runs when `hybridserve` is imported, before
  torch; a value the user set is kept.
- glibc returning every freed large block to the kernel (blocks above 128 KB are mmap'd and
  unmapped on free), so each step's temporaries (gathered KV, activations) are page-faulted
  in again. `keep_freed_memory()` (at engine start) keeps freed memory in the process:
  resident memory stays at its peak, as with the tcmalloc/jemalloc that serving stacks
  preload.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def spin_policy() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_freed_memory() -> bool:
    """Serve every allocation from one heap that is never trimmed; False where the C library
    has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))
