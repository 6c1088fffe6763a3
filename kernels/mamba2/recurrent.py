"""Mamba2 SSD decode path: a step loop over token offsets, batched over sequences."""
from __future__ import annotations

import torch

from kernels.mamba2.chunk import check_ssd_args
from kernels.mamba2.varlen import locate_checkpoints, seq_bounds


def recurrent_ssd(
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
    """Same contract as `chunk_ssd`, for few tokens per sequence (decode: one each).

    Step i advances every sequence that has an i-th token. checkpoint_at may name any
    position inside a sequence. initial_state is read, never written: the new state is
    the returned final_state.
    """
    T, H, P = x.shape
    G, S = B.shape[1:]
    R = H // G
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    check_ssd_args(x, dt, A, B, C, D, initial_state, N)
    lengths = cu[1:] - cu[:-1]  # [N]
    if initial_state is None:
        h = x.new_zeros(N, H, P, S, dtype=torch.float32)
    else:
        h = initial_state.to(device=x.device, dtype=torch.float32, copy=True)
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu)
        states = h.new_empty(len(where.seq), H, P, S)
    y = x.new_empty(T, H, P, dtype=torch.float32)
    for i in range(int(lengths.max()) if T else 0):
        seqs = (lengths > i).nonzero().squeeze(1)  # [M]
        t = cu[seqs] + i
        take = lambda v, t=t: v.index_select(0, t).float()  # noqa: E731
        xt, dtt = take(x).view(-1, G, R, P), take(dt).view(-1, G, R)
        decay = torch.exp(dtt * A.float().view(G, R))  # [M, G, R]
        write = dtt[..., None, None] * xt[..., None] * take(B)[:, :, None, None, :]  # [M, G, R, P, S]
        ht = decay[..., None, None] * h.index_select(0, seqs).view(-1, G, R, P, S) + write
        y.index_copy_(0, t, (ht * take(C)[:, :, None, None, :]).sum(-1).view(-1, H, P))
        h.index_copy_(0, seqs, ht.view(-1, H, P, S))
        if checkpoint_at is not None:
            hit = (where.offset == i + 1).nonzero().squeeze(1)
            states.index_copy_(0, hit, h.index_select(0, where.seq.index_select(0, hit)))
    if D is not None:
        y += D.float()[:, None] * x.float()
    result = (y.to(x.dtype), h if output_final_state else None)
    return result if checkpoint_at is None else result + (states,)
