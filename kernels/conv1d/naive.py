"""Causal conv1d reference: an fp32 loop over sequences and tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mamba2.varlen import locate_checkpoints, seq_bounds


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_at: torch.Tensor | None = None,
):
    """Same contract as `kernels.conv1d.torch.causal_conv1d`, one token at a time."""
    T, D = x.shape
    W = weight.shape[1]
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    wanted: dict[tuple[int, int], list[int]] = {}  # (sequence, offset) -> checkpoint indices
    count = 0
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu)
        for i, (n, off) in enumerate(zip(where.seq.tolist(), where.offset.tolist())):
            wanted.setdefault((n, off), []).append(i)
        count = len(where.seq)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    final = torch.zeros(N, D, W - 1, dtype=torch.float32, device=x.device)
    states = torch.zeros(count, D, W - 1, dtype=torch.float32, device=x.device)
    w = weight.float()
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        tail = final[n] if conv_state is None else conv_state[n].float()  # [D, W-1]
        for t in range(start, end):
            window = torch.cat([tail, x[t].float()[:, None]], dim=1)  # [D, W]
            out = (window * w).sum(1) + (0.0 if bias is None else bias.float())
            y[t] = F.silu(out) if activation == "silu" else out
            tail = window[:, 1:]
            for i in wanted.get((n, t + 1 - start), []):
                states[i] = tail
        final[n] = tail
    result = (y.to(x.dtype), final.to(state_dtype))
    return result if checkpoint_at is None else result + (states.to(state_dtype),)
