"""What each rank runs in the tensor-parallel tests (importable by spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.layers.tensor_parallel import TensorParallel
from tests.models.harness import PagedRunner, prompt


def script(path, vocab: int = 97) -> list[torch.Tensor]:
    """Logits of a fixed sequence of batches, sharded across the default process group when one
    is up: a prefill writing a checkpoint, a mixed batch (continued + fresh prefill), six decode
    steps of both sequences, then a third sequence resumed from the checkpoint."""
    run = PagedRunner(path, tp=TensorParallel.of() if dist.is_initialized() else None)
    a, b = prompt(vocab, 150, 1), prompt(vocab, 40, 2)
    sa, sb, ck = run.new_seq(), run.new_seq(), run.checkpoint_slot()
    out = run.step([(sa, a[:128])], checkpoints={0: [(64, ck)]}, all_logits=True)
    out += run.step([(sa, a[128:]), (sb, b)], all_logits=True)
    for i in range(6):
        out += run.step([(sa, [3 + i]), (sb, [5 + i])])
    other = run.new_seq()
    other.pages = sa.pages[: 64 // run.memory.page_size]
    run.restore(other, ck, a[:64])
    out += run.step([(other, a[64:100])], all_logits=True)
    return out
