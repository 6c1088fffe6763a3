"""Processes joined in one torch.distributed group (gloo on CPU, NCCL on CUDA).

`run_ranks(fn, world, args)` starts `world` processes (spawned, so CUDA is safe), joins them
in the default process group through a file store in a temporary folder, runs `fn(*args)` on
each and returns their results in rank order. A rank that raises makes the call raise with
that rank's traceback; the others are stopped.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def backend_for(device: str | None = None) -> str:
    """NCCL for CUDA devices (for `device=None`: when CUDA is available), else gloo."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "nccl" if cuda else "gloo"


def _rank_main(rank: int, world: int, store: str, backend: str, threads: int, fn: Callable, args: tuple,
               results) -> None:
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=store, rank=rank, world_size=world)
        try:
            results.put((rank, True, pickle.dumps(fn(*args))))  # bytes: no shared-memory handles
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, args: tuple = (), backend: str | None = None, threads: int = 1,
              timeout: float = 600.0) -> list[Any]:
    """fn(*args) on `world` ranks (fn and args picklable; fn at module level); results by rank."""
    if world < 1:
        raise ValueError(f"world: need at least one rank, got {world}")
    backend = backend or backend_for()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store, backend, threads, fn, args, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world:
                if not _wait(results, procs, timeout):
                    raise RuntimeError(f"run_ranks: no result from ranks {sorted(set(range(world)) - set(out))}")
                rank, ok, value = results.get()
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = pickle.loads(value)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world)]


def _wait(results, procs, timeout: float) -> bool:
    """True once a result is queued; False after `timeout` s or when every process has exited
    without one."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not results.empty():
            return True
        if not any(p.is_alive() for p in procs) and results.empty():
            return False
        time.sleep(0.01)
    return False
