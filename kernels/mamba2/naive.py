"""Mamba2 SSD reference: an fp32 loop over sequences and tokens."""
from __future__ import annotations

import torch

from kernels.mamba2.varlen import locate_checkpoints, seq_bounds


def naive_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    checkpoint_at: torch.Tensor | None = None,
):
    """Per token: h <- exp(dt A) h + dt x B^T;  y = h C + D x  (head h reads group h // (H / G)).

    x [T, H, P]; dt [T, H] (after softplus); A [H] (< 0); B, C [T, G, S]; D [H] or None;
    initial_state [N, H, P, S] or None (zeros); cu_seqlens [N+1] or None (one sequence);
    checkpoint_at [C] packed positions (any offset inside a sequence).
    Returns (y [T, H, P] in x.dtype, final_state [N, H, P, S] fp32 or None)
    and states [C, H, P, S] when checkpoint_at is given.
    """
    T, H, P = x.shape
    S = B.shape[-1]
    rep = H // B.shape[1]
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    wanted: dict[tuple[int, int], list[int]] = {}  # (sequence, offset) -> checkpoint indices
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu)
        for i, (n, off) in enumerate(zip(where.seq.tolist(), where.offset.tolist())):
            wanted.setdefault((n, off), []).append(i)
        states = x.new_zeros(len(where.seq), H, P, S, dtype=torch.float32)
    y = torch.zeros(T, H, P, dtype=torch.float32, device=x.device)
    final = torch.zeros(N, H, P, S, dtype=torch.float32, device=x.device)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        h = final[n] if initial_state is None else initial_state[n].float().clone()  # [H, P, S]
        for t in range(start, end):
            xt, dtt = x[t].float(), dt[t].float()  # [H, P], [H]
            bt = B[t].float().repeat_interleave(rep, dim=0)  # [H, S]
            ct = C[t].float().repeat_interleave(rep, dim=0)  # [H, S]
            h = torch.exp(dtt * A.float())[:, None, None] * h + dtt[:, None, None] * xt[:, :, None] * bt[:, None, :]
            y[t] = (h * ct[:, None, :]).sum(-1)
            if D is not None:
                y[t] += D.float()[:, None] * xt
            for i in wanted.get((n, t + 1 - start), []):
                states[i] = h
        final[n] = h
    out = (y.to(x.dtype), final if output_final_state else None)
    return out if checkpoint_at is None else out + (states,)
