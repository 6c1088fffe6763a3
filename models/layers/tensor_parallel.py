"""Tensor parallelism: each rank holds a slice of every layer's heads and channels.

A mixer (KDA, GDN, Mamba2, attention) keeps heads [r H / N, (r + 1) H / N) of its projections,
conv channels, per-head parameters and state; its output projection keeps the matching input
columns, so its output is a partial sum that one all-reduce completes. MLPs and experts keep
an N-th of their intermediate channels (tensor parallel inside every expert, not expert
parallel: routing stays replicated and every rank runs every chosen expert on its slice); the
block's FFN output is all-reduced once. Embedding, norms, routers, low-rank projections
(Kimi's f_a/g_a, MLA's latent down-projection) and lm_head are replicated; MLA's latent KV is
replicated (one head), GQA's KV heads are split. A bias added after a reduced projection is
kept on rank 0 only.

Each sharded parameter carries `tp_slice`, the function from the checkpoint's full tensor to
this rank's slice, so the loader slices each tensor as it reads it (models/loader.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    group: Any  # torch.distributed ProcessGroup (None: the default group)
    rank: int
    world: int

    @classmethod
    def of(cls, group=None) -> "TensorParallel":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


Sections = Sequence[tuple[int, int, str]]  # (rows, heads or groups among them, what) along the sharded dim


def _slice(t: torch.Tensor, sections: Sections, dim: int, tp: TensorParallel) -> torch.Tensor:
    """This rank's N-th of each section of t along dim, concatenated."""
    parts = t.split([n for n, _, _ in sections], dim)
    return torch.cat([p.narrow(dim, tp.rank * (n // tp.world), n // tp.world)
                      for p, (n, _, _) in zip(parts, sections)], dim).contiguous()


def shard(p: nn.Parameter | torch.Tensor | None, tp: TensorParallel, sections: Sections, dim: int = 0) -> None:
    """Keep this rank's share of p (in place) and remember how to cut a checkpoint tensor."""
    if p is None:
        return
    if sum(n for n, _, _ in sections) != p.shape[dim]:
        raise ValueError(f"tensor parallel: sections {list(sections)} do not cover dim {dim} of {tuple(p.shape)}")
    for n, units, what in sections:
        if units % tp.world or n % units:
            raise ValueError(f"tensor parallel: {what}: {units} cannot be split across {tp.world} ranks")

    def cut(t: torch.Tensor) -> torch.Tensor:
        return _slice(t, sections, dim, tp)

    p.data = cut(p.data)
    p.tp_slice = cut  # type: ignore[attr-defined]


def first_rank_only(p: nn.Parameter | None, tp: TensorParallel) -> None:
    """A bias added to a partial sum: rank 0 keeps it, the others hold zeros."""
    if p is None:
        return

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t if tp.rank == 0 else torch.zeros_like(t)

    p.data = cut(p.data)
    p.tp_slice = cut  # type: ignore[attr-defined]


def heads(n: int, units: int, what: str) -> list[tuple[int, int, str]]:
    return [(n, units, what)]


def column(lin: nn.Linear, tp: TensorParallel, sections: Sections) -> None:
    """Output rows of lin (and its bias) by sections."""
    shard(lin.weight, tp, sections)
    shard(lin.bias, tp, sections)
    lin.out_features = lin.weight.shape[0]


def row(lin: nn.Linear, tp: TensorParallel, sections: Sections) -> None:
    """Input columns of lin; its output becomes a partial sum (bias on rank 0 only)."""
    shard(lin.weight, tp, sections, dim=1)
    first_rank_only(lin.bias, tp)
    lin.in_features = lin.weight.shape[1]


def ffn(module: nn.Module, tp: TensorParallel) -> None:
    """An MLP or expert exposing parts() -> (gate or None, up, down, act): an N-th of its
    intermediate channels."""
    gate, up, down, _ = module.parts()  # type: ignore[operator]
    inter = [(up.out_features, tp.world, f"{type(module).__name__} intermediate {up.out_features}")]
    for lin in (gate, up):
        if lin is not None:
            column(lin, tp, inter)
    row(down, tp, inter)


def shard_model(model: Any, tp: TensorParallel) -> None:
    """Shard every block's mixer and FFN (children with a `shard(tp)` method) and all-reduce
    their outputs. A no-op for one rank."""
    if tp.world == 1:
        return
    for block in model.decoder.layers:
        for child in block.children():
            if hasattr(child, "shard"):
                child.shard(tp)
                child.register_forward_hook(lambda _m, _i, out: tp.all_reduce(out))
