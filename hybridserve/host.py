"""Process settings that CPU serving needs, applied before the work starts.

Four defaults of a stock CPU process cost more than the model on small and medium batches:

- How OpenMP threads wait between parallel regions. libgomp's default spins for ~300,000
  iterations: on a machine where another process holds a core, every op then waits a
  scheduler time slice for its descheduled partner thread while the spinning one burns the
  core it needs (tiny ops go from ~40 us to ~8 ms). Sleeping at once (`OMP_WAIT_POLICY=
  PASSIVE`) costs a futex wake-up per parallel region instead: 50-60 us even for a 128-element
  op, which made a decode step of the tiny test models 1.5x slower on an idle machine.
  `spin_policy()` sets a short spin (`GOMP_SPINCOUNT`, about 0.1-0.3 ms) and `ThreadGovernor`
  drops to fewer threads while other processes hold the cores, so nothing spins on a busy
  machine. libgomp reads its environment when it loads, so `spin_policy()` runs when
  `hybridserve` is imported, before torch; a wait policy or spin count the user set is kept.
- glibc returning every freed large block to the kernel (blocks above 128 KB are mmap'd and
  unmapped on free), so each step's temporaries (gathered KV, activations) are page-faulted
  in again. `keep_freed_memory()` (at engine start) keeps freed memory in the process:
  resident memory stays at its peak, as with the tcmalloc/jemalloc that serving stacks
  preload.
- Python's full garbage collections walking every object alive. A serving process holds
  hundreds of thousands after start-up (torch, the model, the web stack), and one such pass
  on the server's event loop took 183 ms while it held the GIL: the engine thread stalled
  mid-decode (the p99 inter-token latency of a served run). `freeze_heap()`, once the server
  has started, collects once and moves what is alive out of the collector's reach
  (`gc.freeze`); later passes walk only what came after. `gc.unfreeze()` at shutdown gives
  it back.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


SPIN_COUNT = 10_000  # libgomp spin iterations before a waiting thread sleeps


def spin_policy() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


class ThreadGovernor:
    """Intra-op threads = the CPUs this process may use minus the cores other processes kept
    busy over the last `interval` seconds (from /proc/stat, less this process's own CPU time),
    between 1 and `ceiling`. `update()` before each round; it reads /proc at most once an
    interval (~40 us) and calls `set_threads` only when the count changes. Where /proc/stat is
    not readable it keeps `ceiling`.

    `round_ended()` after each round: a window in which no round ran for more than `interval`
    is dropped (the count kept, a new window begun). What others did while this process asked
    for nothing is not contention for its next rounds: a client starting up or building its
    requests, then waiting on the answers, would otherwise put the first rounds of every burst
    on fewer threads.

    `partners`: processes whose CPU time counts as this one's (an engine process's server front:
    its event loop works for the same requests, and is not contention to yield to)."""

    def __init__(self, ceiling: int, set_threads, interval: float = 0.2, clock=time.monotonic,
                 stat_path: str = "/proc/stat", own_cpu=None, partners: tuple[int, ...] = ()):
        self.ceiling, self.set_threads, self.interval, self.clock = ceiling, set_threads, interval, clock
        self.stat_path = stat_path
        self.own_cpu = own_cpu or (lambda: sum(os.times()[:2]) + sum(map(process_cpu, partners)))
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        self.cpus = {f"cpu{c}" for c in allowed}
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # no /proc/stat there anyway
        self.threads = ceiling
        self.others = 0.0  # cores others kept busy over the last interval
        self._last = self._sample()
        self._ended: float | None = None  # when the last round ended

    def _sample(self) -> tuple[float, float, float] | None:
        """(now, busy CPU seconds of our CPUs, this process's CPU seconds), or None."""
        busy = 0
        try:
            with open(self.stat_path) as f:
                for line in f:
                    name, *ticks = line.split() or [""]
                    if name in self.cpus:  # user nice system idle iowait irq softirq steal ...
                        t = [int(x) for x in ticks[:8]]
                        busy += sum(t) - t[3] - t[4]
        except (OSError, ValueError, IndexError):
            return None
        return self.clock(), busy / self.tick, self.own_cpu()

    def round_ended(self) -> None:
        self._ended = self.clock()

    def update(self) -> int:
        now = self.clock()
        if self._ended is not None and now - self._ended > self.interval:  # idle since: a new window
            self._ended, self._last = None, self._sample()
            return self.threads
        if self._last is None or now - self._last[0] < self.interval:
            return self.threads
        sample = self._sample()
        if sample is None:
            return self.threads
        (t0, busy0, own0), (t1, busy1, own1) = self._last, sample
        self._last = sample
        self.others = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
        threads = max(1, min(self.ceiling, round(len(self.cpus) - self.others)))
        if threads != self.threads:
            self.threads = threads
            self.set_threads(threads)
        return threads


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used; 0 where /proc cannot tell (it ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def freeze_heap() -> int:
    """Collect, then exempt every object alive from later collections; how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


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
