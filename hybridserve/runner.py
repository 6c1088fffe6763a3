"""ModelRunner: a scheduled round -> ForwardBatch -> logits -> sampled tokens."""
from __future__ import annotations

import time
from typing import Callable

import torch

from hybridserve.sampling import Sampler
from models.batch import ForwardBatch, Memory, Segment
from scheduler import Batch, Executor, StepOutput


class ModelRunner(Executor):
    """Runs the model on the pools' tensors; checkpoint states are written by the forward
    straight into the rows of the checkpoint slots the scheduler allocated for each chunk
    (`row`: the state pool's slot -> row map; under the unified budget, staging rows that
    the cache later moves into KV-pool pages)."""

    def __init__(self, model, memory: Memory, device: str, sampler: Sampler, row: Callable[[int], int] = int):
        self.model, self.memory, self.device, self.sampler, self.row = model, memory, device, sampler, row

    def segments(self, batch: Batch) -> list[Segment]:
        segs = [Segment(c.req.all_ids[c.start:c.end], c.start, c.req.active_slot, c.req.kv_pages,
                        tuple((p, self.row(s)) for p, s in c.checkpoints), c.req)
                for c in batch.chunks]
        segs += [Segment([r.all_ids[r.prefix_len]], r.prefix_len, r.active_slot, r.kv_pages, (), r)
                 for r in batch.decodes]  # the last sampled token, at position prefix_len
        return segs

    @torch.inference_mode()
    def run(self, batch: Batch) -> StepOutput:
        t0 = time.perf_counter()
        segs = self.segments(batch)
        sampling = [i for i, c in enumerate(batch.chunks) if c.samples]
        sampling += list(range(len(batch.chunks), len(segs)))
        logits = self.forward(segs, sampling)  # [S, vocab], one row per sampling segment
        reqs = batch.sampling_reqs
        out = self.sampler(logits, [r.sampling for r in reqs], [r.rid for r in reqs])
        scored = [None if lp is None else (lp, top) for lp, top in zip(out.logprobs, out.top_logprobs)]
        return StepOutput(out.tokens, time.perf_counter() - t0, scored)  # None: logprobs not asked for

    def forward(self, segs: list[Segment], sampling: list[int]) -> torch.Tensor:
        """Logits [len(sampling), vocab] at the last token of the segments listed in `sampling`."""
        return self.model(ForwardBatch.build(segs, self.memory, self.device, logits_for=sampling))
