"""Serving on several ranks: one process per rank, joined in one torch.distributed group.

Rank 0 is the engine's own process: it runs the scheduler, the cache index, the sampler and
its part of the model. Ranks 1..N-1 are workers started here (spawned), each with the same
pools (same pages and slots) and no bookkeeping. For every round rank 0 sends each worker,
over a pipe, the round's segments (token ids, positions, slots, pages, checkpoint rows), which
segment (if any) runs split, and the pools' tensor operations recorded since the last round
(state_cache/journal.py); all ranks then run the round together (`run_round`).

- Tensor parallel: each rank holds its shard of the model and its heads of every pool; the
  layers' all-reduces meet in the group; every rank's logits are the same.
- Context parallel: each rank holds the whole model and a replica of the pools. The round's
  longest prefill segment, when it has at least N x G tokens, is split across the ranks
  (models/layers/context_parallel.py; its KV, final state and checkpoints end on every rank);
  the rest of the round runs replicated on every rank, so the replicas stay equal.

A failure inside a forward leaves the group unusable: the runner stops the workers and every
later round raises. Aborts and failed requests free their pages and slots on rank 0, which is
where every rank's pages and slots are accounted.
"""
from __future__ import annotations

import datetime
import logging
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridserve.distributed import backend_for
from hybridserve.runner import ModelRunner
from models.batch import ForwardBatch, Memory, Segment
from models.layers.context_parallel import context_parallel_batch
from models.layers.tensor_parallel import TensorParallel
from state_cache import Journal, replay

log = logging.getLogger(__name__)
TIMEOUT = datetime.timedelta(minutes=5)  # a collective waiting this long on a rank fails the round


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU per rank), else the configured one."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


class Workers:
    """Ranks 1..N-1 of an engine; this process joins the group as rank 0."""

    def __init__(self, config, world: int):
        if dist.is_initialized():
            raise ValueError("tensor_parallel_size, context_parallel_size: this process already has a "
                             "torch.distributed group; one multi-rank engine per process")
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        store = "file://" + os.path.join(self._dir.name, "store")
        self.pipes, self.procs = [], []
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(config, rank, world, store, theirs), daemon=True)
            proc.start()
            self.pipes.append(ours)
            self.procs.append(proc)
        dist.init_process_group(backend_for(config.device), init_method=store, rank=0, world_size=world,
                                timeout=TIMEOUT)
        self.alive = True

    def send(self, message) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.alive:
            self.alive = False
            for pipe in self.pipes:
                try:
                    pipe.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self._dir.cleanup()


Split = tuple[int, int]  # (segment index, slice alignment G): that segment runs context parallel


def run_round(model, memory: Memory, device: str, segs: list[Segment], sampling: list[int],
              split: Split | None) -> torch.Tensor:
    """Logits [len(sampling), vocab] of one round, on every rank: segment split[0] context
    parallel (slices on the G grid), the others in one replicated forward; without a split,
    one forward (tensor parallel, or one rank)."""
    if split is None:
        return model(ForwardBatch.build(segs, memory, device, logits_for=sampling))
    at, align = split
    out: dict[int, torch.Tensor] = {}
    rest = [s for i, s in enumerate(segs) if i != at]
    if rest:
        wanted = [i for i in sampling if i != at]
        logits = model(ForwardBatch.build(rest, memory, device, logits_for=[i - (i > at) for i in wanted]))
        out.update(zip(wanted, logits))
    last = model(context_parallel_batch(segs[at], memory, align=align, device=device))[-1].contiguous()
    if at in sampling:  # the segment's last token is the last rank's
        dist.broadcast(last, dist.get_world_size() - 1)
        out[at] = last
    return torch.stack([out[i] for i in sampling])


class ParallelRunner(ModelRunner):
    """ModelRunner on rank 0: each round goes to the workers first, then runs here.
    `cp`: ranks a long prefill segment is split across (1: tensor parallel); `align`: G."""

    def __init__(self, model, memory: Memory, device: str, sampler, row, workers: Workers, journal: Journal,
                 cp: int = 1, align: int = 64):
        super().__init__(model, memory, device, sampler, row)
        self.workers, self.journal, self.cp, self.align = workers, journal, cp, align
        self.split_rounds = 0

    def forward(self, segs: list[Segment], sampling: list[int]) -> torch.Tensor:
        if not self.workers.alive:
            raise RuntimeError("parallel: the workers were stopped after a failed round; restart the engine")
        split = self.pick_split(segs)
        plain = [Segment(list(s.input_ids), s.prefix_len, s.state_slot, list(s.pages), tuple(s.checkpoints))
                 for s in segs]
        self.workers.send((plain, sampling, split, self.journal.drain()))
        try:
            logits = run_round(self.model, self.memory, self.device, segs, sampling, split)
        except BaseException:
            log.error("parallel: a round failed on rank 0; stopping the workers")
            self.workers.close()
            raise
        self.split_rounds += split is not None
        return logits

    def pick_split(self, segs: list[Segment]) -> Split | None:
        """The longest segment, if context parallel and it has a slice of >= G for every rank."""
        if self.cp == 1:
            return None
        at = max(range(len(segs)), key=lambda i: len(segs[i].input_ids))
        return (at, self.align) if len(segs[at].input_ids) >= self.cp * self.align else None


def _worker(config, rank: int, world: int, store: str, pipe) -> None:
    """Rank `rank`: its part of the model and pools; replays rank 0's rounds until told to stop."""
    from hybridserve.engine import build_memory, load_engine_model

    device = rank_device(config.device, rank)
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(config.device), init_method=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        tp = TensorParallel.of() if config.tensor_parallel_size > 1 else None
        model, mc = load_engine_model(config, device, tp)
        _, kv, state, host = build_memory(config, mc, device)
        memory = Memory(kv.buffers, state.buffers, config.page_size)
        pools = {"kv": kv, "state": state, "host": host}
        with torch.inference_mode():
            while (message := pipe.recv()) is not None:
                segs, sampling, split, ops = message
                replay(ops, pools)
                run_round(model, memory, device, segs, sampling, split)
    except EOFError:  # rank 0 went away
        pass
    finally:
        dist.destroy_process_group()

