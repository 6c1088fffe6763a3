"""Packed varlen tokens <-> 64-token chunks laid out step by step.

Sequences are ranked by chunk count (most first). Chunk c of the sequence of rank r has
flat index `steps[c].start + r`, so the chunks that the inter-chunk recurrence handles at
step c are one contiguous range, and the sequences still running at step c are the ranks
[0, steps[c].active). The chunk path walks the steps in blocks of consecutive steps,
gathering each block's tokens into [chunks, H, CHUNK, D] (zero padding past a sequence's
end: k = v = q = 0, beta = 0, g = 0 leaves the state unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from kernels.kda.common import CHUNK, Checkpoints


class Step(NamedTuple):
    """Chunks [start, start + active) are chunk c of the sequences of rank [0, active)."""

    start: int
    active: int


class Block(NamedTuple):
    """Consecutive steps (index, Step) covering flat chunks [start, stop) and tokens[lo:hi]."""

    start: int
    stop: int
    steps: list[tuple[int, Step]]
    lo: int
    hi: int


@dataclass(frozen=True)
class ChunkLayout:
    steps: list[Step]
    order: torch.Tensor  # [N] sequence of each rank
    rank: torch.Tensor  # [N] rank of each sequence
    tokens: torch.Tensor  # [T] token indices in (flat chunk, position) order
    chunk_of: torch.Tensor  # [T] flat chunk of tokens[i]
    pos_of: torch.Tensor  # [T] position of tokens[i] inside its chunk
    first_token: list[int]  # [num_chunks + 1] index into `tokens` where each chunk starts

    @classmethod
    def build(cls, cu: list[int], device: torch.device) -> "ChunkLayout":
        lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])  # [N]
        chunks = (lengths + CHUNK - 1) // CHUNK
        order = torch.sort(chunks, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order))
        active = [int((chunks > c).sum()) for c in range(int(chunks.max()))]
        starts = torch.tensor([0] + active).cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
        local = torch.arange(cu[-1]) - torch.tensor(cu[:-1])[seq]  # [T]
        flat = starts[local // CHUNK] + rank[seq]  # [T]
        tokens = torch.sort(flat * CHUNK + local % CHUNK).indices
        first = torch.searchsorted(flat[tokens], torch.arange(int(starts[-1]) + 1))
        return cls(
            steps=[Step(int(s), a) for s, a in zip(starts, active)],
            order=order.to(device),
            rank=rank.to(device),
            tokens=tokens.to(device),
            chunk_of=flat[tokens].to(device),
            pos_of=(local % CHUNK)[tokens].to(device),
            first_token=first.tolist(),
        )

    def blocks(self, size: int) -> Iterator[Block]:
        """Consecutive steps grouped into blocks of at least `size` chunks (but the last)."""
        group: list[tuple[int, Step]] = []
        for c, step in enumerate(self.steps):
            group.append((c, step))
            start, stop = group[0][1].start, step.start + step.active
            if stop - start >= size or c == len(self.steps) - 1:
                yield Block(start, stop, group, self.first_token[start], self.first_token[stop])
                group = []

    @property
    def single(self) -> bool:
        """One sequence: tokens are already in chunk order."""
        return len(self.order) == 1

    def gather(self, block: Block, *xs: torch.Tensor) -> torch.Tensor:
        """The block's tokens of [T, H, D_i] tensors -> [chunks, H, CHUNK, sum D_i] fp32, side by side."""
        out = xs[0].new_empty(block.stop - block.start, xs[0].shape[1], CHUNK, sum(x.shape[2] for x in xs),
                              dtype=torch.float32)
        parts = out.split([x.shape[2] for x in xs], dim=-1)
        if self.single:  # whole chunks by reshaping, then the tail, zero padded
            full, tail = divmod(block.hi - block.lo, CHUNK)
            out[full:] = 0
            for dst, x in zip(parts, xs):
                dst[:full] = x[block.lo:block.lo + full * CHUNK].unflatten(0, (full, CHUNK)).transpose(1, 2)
                if tail:
                    dst[full, :, :tail] = x[block.hi - tail:block.hi].transpose(0, 1)
            return out
        out.zero_()
        tok = self.tokens[block.lo:block.hi]
        chunk, pos = self.chunk_of[block.lo:block.hi] - block.start, self.pos_of[block.lo:block.hi]
        for dst, x in zip(parts, xs):
            dst[chunk, :, pos] = x[tok].float()
        return out

    def scatter(self, block: Block, y: torch.Tensor, out: torch.Tensor) -> None:
        """Write y [chunks, H, CHUNK, D] of the block to its tokens' rows of out [T, H, D]."""
        if self.single:
            out[block.lo:block.hi] = y.transpose(1, 2).flatten(0, 1)[:block.hi - block.lo]
            return
        chunk, pos = self.chunk_of[block.lo:block.hi] - block.start, self.pos_of[block.lo:block.hi]
        out[self.tokens[block.lo:block.hi]] = y[chunk, :, pos].to(out.dtype)

    def captures(self, cp: Checkpoints) -> dict[int, list[tuple[int, int]]]:
        """step index -> [(checkpoint index, rank)] whose state is the rank's state after that step."""
        done = (cp.length + CHUNK - 1) // CHUNK  # chunks of the sequence up to the position
        plan: dict[int, list[tuple[int, int]]] = {}
        for i, (c, r) in enumerate(zip((done - 1).tolist(), self.rank.cpu()[cp.seq].tolist())):
            plan.setdefault(c, []).append((i, r))
        return plan
