"""Mamba2 SSD on CUDA through mamba-ssm (imported on first call).

mamba-ssm 2.x `mamba_chunk_scan_combined` keeps packed sequences apart with `seq_idx` and
returns each sequence's final state with `cu_seqlens` + `return_varlen_states`, but takes one
initial state per batch row, not per packed sequence, and returns no intermediate states.
So we cut every sequence at its checkpoints into pieces, run all pieces in one call from
zero states, and add the carried state by linearity, piece by piece in order:

    y_t   += exp(a_s + ... + a_t) C_t . h_in        (a = dt * A, s = first token of the piece)
    h_out  = exp(a_s + ... + a_e) h_in + h_piece    (h_piece: the piece's zero-start state)

The loop is over pieces (sequences + checkpoints); each step is a small einsum.
"""
from __future__ import annotations

import torch

from kernels.mamba2.chunk import CHUNK_SIZE, check_ssd_args, chunk_ssd
from kernels.mamba2.recurrent import recurrent_ssd
from kernels.mamba2.varlen import locate_checkpoints, seq_bounds


def cuda_chunk_ssd(
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
    chunk_size: int = CHUNK_SIZE,
):
    """Same contract and results as `kernels.mamba2.chunk.chunk_ssd`, on CUDA tensors."""
    T, H, P = x.shape
    G, S = B.shape[1:]
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    check_ssd_args(x, dt, A, B, C, D, initial_state, N)
    if T == 0:
        return chunk_ssd(x, dt, A, B, C, D, initial_state, output_final_state, cu, checkpoint_at, chunk_size)
    cuts = [cu]
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu, multiple_of=chunk_size)
        cuts.append(cu[where.seq] + where.offset)
    bounds = torch.unique(torch.cat(cuts))  # [M+1] sorted piece boundaries
    y, piece_states = _scan_pieces(x, dt, A, B, C, D, bounds, chunk_size)  # [T, H, P], [M, H, P, S]

    a = dt.float() * A.float()  # [T, H]
    seq_start, seq_end = set(cu[:-1].tolist()), cu[1:].tolist()
    h = None if initial_state is None else initial_state.to(device=x.device, dtype=torch.float32)
    state_at = {}  # packed end position of a piece -> state there
    carried, n = None, 0
    for i, (s, e) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        while seq_end[n] < e:
            n += 1  # skip empty sequences
        if s in seq_start:
            carried = None if h is None else h[n]
        decay = torch.cumsum(a[s:e], dim=0)  # [L, H]
        if carried is not None:
            from_entry = torch.einsum("lgs,grps->lgrp", C[s:e].float(), carried.view(G, H // G, P, S))
            y[s:e] = (y[s:e].float() + from_entry.reshape(-1, H, P) * torch.exp(decay)[..., None]).to(y.dtype)
            carried = torch.exp(decay[-1])[:, None, None] * carried + piece_states[i]
        else:
            carried = piece_states[i]
        state_at[e] = carried
    final = x.new_zeros(N, H, P, S, dtype=torch.float32) if h is None else h.clone()
    for k, (s, e) in enumerate(zip(cu[:-1].tolist(), seq_end)):
        if e > s:
            final[k] = state_at[e]
    result = (y, final if output_final_state else None)
    if checkpoint_at is None:
        return result
    ends = (cu[where.seq] + where.offset).tolist()
    return result + (torch.stack([state_at[p] for p in ends]) if ends else final[:0],)


def _scan_pieces(x, dt, A, B, C, D, bounds, chunk_size):
    """One mamba-ssm call over pieces bounds [M+1], each from a zero state.

    Returns (y [T, H, P] in x.dtype with D * x added, state at each piece's end [M, H, P, S] fp32).
    """
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    lengths = bounds[1:] - bounds[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
    y, states = mamba_chunk_scan_combined(
        x[None], dt[None].float(), A.float(), B[None].to(x.dtype), C[None].to(x.dtype), chunk_size,
        D=None if D is None else D.float(),
        seq_idx=seq_idx[None].to(torch.int32).contiguous(),
        cu_seqlens=bounds,
        return_varlen_states=True,
    )
    return y[0], states.float()


def cuda_recurrent_ssd(
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
    """Same contract as `recurrent_ssd`: mamba-ssm's `selective_state_update` when every
    sequence has exactly one token and no checkpoint is asked; the torch step loop otherwise.
    initial_state is not written (the kernel updates a copy, returned as final_state).
    """
    T, H, P = x.shape
    S = B.shape[2]
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    if checkpoint_at is not None or N != T or T == 0 or not bool((cu[1:] - cu[:-1] == 1).all()):
        return recurrent_ssd(x, dt, A, B, C, D, initial_state, output_final_state, cu, checkpoint_at)
    check_ssd_args(x, dt, A, B, C, D, initial_state, N)
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    if initial_state is None:
        state = x.new_zeros(N, H, P, S, dtype=torch.float32)
    else:
        state = initial_state.to(dtype=torch.float32, copy=True)
    per_head = lambda v: v.float()[:, None].expand(H, P)  # noqa: E731  stride 0 on P: the kernel's tied path
    y = selective_state_update(
        state, x, dt[..., None].expand(N, H, P), A.float()[:, None, None].expand(H, P, S), B, C,
        D=None if D is None else per_head(D),
        dt_bias=per_head(A.new_zeros(H)),  # mamba-ssm reads dt_bias.stride when A and dt are tied
    )
    return y.to(x.dtype), state if output_final_state else None
