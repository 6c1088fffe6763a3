"""What each rank runs in the context-parallel tests (importable by spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.batch import ForwardBatch
from models.layers.context_parallel import context_parallel_batch
from tests.models.harness import PagedRunner


def forward(path, ids: list[int], prefix: int, checkpoints: list[int], align: int, device: str = "cpu") -> dict:
    """Our model over `ids`: the first `prefix` tokens as a plain prefill, the rest as one
    segment with checkpoints at the given offsets into it, split across the ranks of the
    default process group when one is up. Returns the segment's logits [T, vocab], the states
    of the sequence's slot and checkpoint slots, and the KV of the sequence's pages."""
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    run = PagedRunner(path, device=device)
    seq = run.new_seq()
    if prefix:
        run.step([(seq, ids[:prefix])])
    cks = [(prefix + off, run.checkpoint_slot()) for off in checkpoints]
    seg = run.segment(seq, ids[prefix:], cks)
    if dist.is_initialized():
        batch = context_parallel_batch(seg, run.memory, align=align, device=device, all_logits=True)
        logits = batch.cp.gather_tokens(run.model(batch))
    else:
        logits = run.model(ForwardBatch.build([seg], run.memory, device, all_logits=True))
    slots = torch.tensor([seq.slot] + [s for _, s in cks], device=device)
    pages = torch.tensor(seq.pages, device=device)
    return {
        "logits": logits.cpu(),
        "states": [{n: buf[slots].cpu() for n, buf in layer.items()} for layer in run.memory.state],
        "kv": [{n: buf[pages].cpu() for n, buf in layer.items()} for layer in run.memory.kv],
    }


def forward_all(cases: list[tuple]) -> list[dict]:
    return [forward(*case) for case in cases]
