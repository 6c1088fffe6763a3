"""Packed-varlen bookkeeping shared by the Mamba2 and conv1d kernels.

`cu_seqlens [N+1]` splits the packed token axis into N sequences; `checkpoint_at [C]` names
packed positions p with cu[n] < p <= cu[n+1], each meaning "the state after consuming
tokens cu[n] .. p-1".
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Checkpoints(NamedTuple):
    """Where each requested checkpoint falls: its sequence and its offset inside it."""

    seq: torch.Tensor  # [C] int64, sequence index n
    offset: torch.Tensor  # [C] int64, p - cu[n], in 1 .. len(n)


def seq_bounds(cu_seqlens: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens as int64 [N+1] on `device` (one sequence when None), validated."""
    if cu_seqlens is None:
        return torch.tensor([0, num_tokens], dtype=torch.int64, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={num_tokens} without decreasing, got {bounds}")
    return cu


def locate_checkpoints(
    checkpoint_at: torch.Tensor, cu: torch.Tensor, multiple_of: int | None = None
) -> Checkpoints:
    """Sequence and offset of each checkpoint position; ValueError names a bad one.

    With `multiple_of`, an offset must be a multiple of it or the end of its sequence.
    """
    pos = checkpoint_at.to(device=cu.device, dtype=torch.int64).reshape(-1)  # [C]
    seq = torch.searchsorted(cu[1:], pos, side="left")  # first n with cu[n+1] >= p
    inside = (pos > 0) & (pos <= cu[-1])
    seq = seq.clamp(max=cu.numel() - 2)
    offset = pos - cu[seq]
    length = cu[seq + 1] - cu[seq]
    ok = inside & (offset > 0)
    if multiple_of is not None:
        ok &= (offset % multiple_of == 0) | (offset == length)
    if not bool(ok.all()):
        bad = pos[~ok].tolist()
        rule = "" if multiple_of is None else f", at a multiple of {multiple_of} from the sequence start or at its end"
        raise ValueError(f"checkpoint_at positions {bad} are not inside a sequence (cu[n] < p <= cu[n+1]{rule})")
    return Checkpoints(seq, offset)
