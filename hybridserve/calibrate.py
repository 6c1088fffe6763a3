"""Fit the step-time model of a model on this machine by timing real forwards."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Iterator

import torch

from models.batch import ForwardBatch, Memory, Segment
from models.config import ModelConfig
from scheduler import BatchShape, CostModel

log = logging.getLogger(__name__)

# (prefix, extend) prefills and decode contexts; `quick` keeps the cheap half
PREFILLS = [[(0, 64)], [(0, 256)], [(0, 1024)], [(1024, 256)], [(0, 64)] * 8, [(2048, 1024)], [(0, 4096)]]
DECODES = [[128], [128] * 8, [1024] * 8, [128] * 32, [2048] * 32]
MAX_CONTEXT = 16384


def long_context(max_context: int) -> list[BatchShape]:
    """Shapes whose attention reads a long prefix. Attention per (query, key) pair gets dearer
    once the prefix outgrows the caches (on a 2-core CPU, 1.9e-8 s per pair fitted up to 4K
    against ~3.6e-8 s measured at 16K), so the fit needs the context range that is served."""
    ctxs = [c for c in (4096, 8192, 16384, 32768, 65536) if c <= max_context]
    return ([BatchShape([(c - 1024, 1024)]) for c in ctxs] + [BatchShape([(0, max_context)])]
            + [BatchShape([(0, 64)], [max_context // 2] * 8), BatchShape((), [max_context] * 8)])


def calibrate(model, mc: ModelConfig, memory: Memory, cache, quick: bool = False, repeats: int = 3,
              max_context: int = MAX_CONTEXT) -> CostModel:
    """Time forwards of representative shapes on the engine's pools and fit the cost model.

    Uses free pages and slots of `cache`'s pools (returned afterwards); contents are garbage,
    which is fine for timing. A shape larger than the free pool is shrunk until it fits.
    Unless `quick`, shapes reach `max_context` tokens of prefix (see `long_context`).
    """
    shapes = [BatchShape(p) for p in PREFILLS] + [BatchShape((), d) for d in DECODES] + long_context(max_context)
    if quick:
        shapes = [s for s in shapes if s.tokens + sum(s.decode) // 64 <= 1024]
    pages, slots = cache.kv_pool.num_free, cache.state_pool.num_free_active
    fitted = [s for s in dict.fromkeys(fit_to_pool(s, pages, slots, memory.page_size) for s in shapes) if s.tokens]
    t0 = time.perf_counter()
    samples = [(shape, _time_forward(model, memory, cache, shape, repeats)) for shape in fitted]
    log.info("calibration: timed %d shapes in %.1f s", len(samples), time.perf_counter() - t0)
    chunk = min(mc.kernel_chunks.values())
    fitted_model = CostModel.fit(samples, chunk=chunk, attn_layers=len(mc.attn_layers),
                                 meta={"model": mc.model_type, "fitted_on": f"{len(samples)} timed forwards"})
    return dataclasses.replace(fitted_model, host_bytes_per_s=host_link(memory))


def host_link(memory: Memory, nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of a device -> host copy of nbytes (pinned host memory on a GPU; a
    memory copy on CPU), the fastest of `repeats`: the host tier's link."""
    ref = next(iter(memory.kv[0].values())) if memory.kv else torch.empty(0)
    src = torch.empty(nbytes, dtype=torch.uint8, device=ref.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ref.device.type == "cuda")
    best = float("inf")
    for _ in range(repeats):
        _sync(ref.device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(ref.device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def fit_to_pool(shape: BatchShape, pages: int, slots: int, page_size: int) -> BatchShape:
    """shape cut to at most `slots` rows, its lengths halved (then rows dropped) until its KV
    fits in `pages` pages."""
    prefill = list(shape.prefill)[:slots]
    decode = list(shape.decode)[: slots - len(prefill)]
    while (prefill or decode) and _pages(prefill, decode, page_size) > pages:
        if any(p + e > 1 for p, e in prefill) or any(c > 1 for c in decode):
            prefill = [(p // 2, max(1, e // 2)) for p, e in prefill]
            decode = [max(1, c // 2) for c in decode]
        elif decode:
            decode.pop()
        else:
            prefill.pop()
    return BatchShape(tuple(prefill), tuple(decode))


def _pages(prefill, decode, page_size: int) -> int:
    rows = list(prefill) + [(c, 1) for c in decode]
    return sum(-(-(p + e) // page_size) for p, e in rows)


@contextlib.contextmanager
def on_pool(memory: Memory, cache, shape: BatchShape) -> Iterator[list[Segment]]:
    """Segments of `shape` on free pages and active slots of `cache`'s pools (their contents
    garbage, each prefill segment's tokens all 1), given back afterwards."""
    ps, kv, st = memory.page_size, cache.kv_pool, cache.state_pool
    rows = [(p, e) for p, e in shape.prefill] + [(c, 1) for c in shape.decode]
    pages, slots, segs = kv.alloc(_pages(rows, [], ps)), [st.alloc_active() for _ in rows], []
    at = 0
    for (p, e), slot in zip(rows, slots):
        n = -(-(p + e) // ps)
        segs.append(Segment([1] * e, p, slot, pages[at:at + n]))
        at += n
    try:
        yield segs
    finally:
        kv.free(pages)
        for s in slots:
            st.free(s)


def _time_forward(model, memory: Memory, cache, shape: BatchShape, repeats: int) -> float:
    device = next(model.parameters()).device
    with on_pool(memory, cache, shape) as segs:
        times = []
        for _ in range(repeats + 1):
            batch = ForwardBatch.build(segs, memory, device=str(device))
            t0 = time.perf_counter()
            model(batch)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times[1:])  # the first run warms up; noise only adds time


def warm_up(model, memory: Memory, cache, tokens: int, max_len: int) -> BatchShape:
    """One forward of a prefill of about `tokens` tokens (fewer where the free pages or slots
    cannot hold them) in prompts of at most `max_len`, spread over as many active slots as are
    free so that their attention stays short; returns the shape that ran."""
    slots, device = cache.state_pool.num_free_active, next(model.parameters()).device
    length = min(max_len, -(-tokens // max(slots, 1)))
    shape = fit_to_pool(BatchShape([(0, length)] * -(-tokens // length)), cache.kv_pool.num_free, slots,
                        memory.page_size)
    if shape.tokens:
        with on_pool(memory, cache, shape) as segs:
            model(ForwardBatch.build(segs, memory, device=str(device)))
            _sync(device)
    return shape


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
