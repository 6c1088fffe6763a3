"""Fit the step-time model of a model on this machine by timing real forwards."""
from __future__ import annotations

import statistics
import time

import torch

from models.batch import ForwardBatch, Memory, Segment
from models.config import ModelConfig
from scheduler import BatchShape, CostModel

# (prefix, extend) prefills and decode contexts; `quick` keeps the cheap half
PREFILLS = [[(0, 64)], [(0, 256)], [(0, 1024)], [(1024, 256)], [(0, 64)] * 8, [(2048, 1024)], [(0, 4096)]]
DECODES = [[128], [128] * 8, [1024] * 8, [128] * 32, [2048] * 32]


def calibrate(model, mc: ModelConfig, memory: Memory, cache, quick: bool = False, repeats: int = 3) -> CostModel:
    """Time forwards of representative shapes on the engine's pools and fit the cost model.

    Uses free pages and slots of `cache`'s pools (returned afterwards); contents are garbage,
    which is fine for timing.
    """
    shapes = [BatchShape(p) for p in PREFILLS] + [BatchShape((), d) for d in DECODES]
    if quick:
        shapes = [s for s in shapes if s.tokens + sum(s.decode) // 64 <= 1024]
    samples = []
    for shape in shapes:
        t = _time_forward(model, memory, cache, shape, repeats)
        if t is not None:
            samples.append((shape, t))
    chunk = min(mc.kernel_chunks.values())
    return CostModel.fit(samples, chunk=chunk, attn_layers=len(mc.attn_layers),
                         meta={"model": mc.model_type, "fitted_on": f"{len(samples)} timed forwards"})


def _time_forward(model, memory: Memory, cache, shape: BatchShape, repeats: int) -> float | None:
    ps, kv, st = memory.page_size, cache.kv_pool, cache.state_pool
    rows = [(p, e) for p, e in shape.prefill] + [(c, 1) for c in shape.decode]
    need = sum(-(-(p + e) // ps) for p, e in rows)
    if need > kv.num_free or len(rows) > st.num_free_active:
        return None  # the pools are too small for this shape
    pages, slots, segs = kv.alloc(need), [st.alloc_active() for _ in rows], []
    at = 0
    for (p, e), slot in zip(rows, slots):
        n = -(-(p + e) // ps)
        segs.append(Segment([1] * e, p, slot, pages[at:at + n]))
        at += n
    try:
        times = []
        for _ in range(repeats + 1):
            batch = ForwardBatch.build(segs, memory, device=str(next(model.parameters()).device))
            t0 = time.perf_counter()
            model(batch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])  # the first run warms up
    finally:
        kv.free(pages)
        for s in slots:
            st.free(s)
