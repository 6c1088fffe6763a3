"""Argument checks shared by every delta-rule path (KDA and GDN; naive, chunk, decode, FLA).

The contract: q, k [T, H, K]; v [T, HV, V] with HV % H == 0; g [T, HV, K] (KDA) or [T, HV]
(GDN) log decays; beta [T, HV]; initial_state [N, HV, K, V] fp32 or None; cu_seqlens [N+1]
int64 or None (one sequence); checkpoint_at int64 [C] packed positions.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK = 64


class DeltaShapes(NamedTuple):
    """Sizes of one delta-rule call."""

    T: int
    N: int
    H: int
    HV: int
    K: int
    V: int


class Checkpoints(NamedTuple):
    """checkpoint_at resolved to (sequence, tokens of that sequence consumed), each [C] int64."""

    seq: torch.Tensor
    length: torch.Tensor


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate: bool) -> DeltaShapes:
    """Validate shapes and dtypes (without reading device memory: the values of cu_seqlens are
    checked by seq_bounds); raise ValueError naming the bad argument."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K], got q={tuple(q.shape)} k={tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T or v.shape[1] % H != 0:
        raise ValueError(f"v must be [T={T}, HV, V] with HV % H({H}) == 0, got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    g_shape = (T, HV) if scalar_gate else (T, HV, K)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must be {list(g_shape)}, got {list(g.shape)}")
    if tuple(beta.shape) != (T, HV):
        raise ValueError(f"beta must be [{T}, {HV}], got {list(beta.shape)}")
    if cu_seqlens is None:
        N = 1
    elif cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype != torch.int64:
        raise ValueError(f"cu_seqlens must be int64 [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    else:
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V) or initial_state.dtype != torch.float32:
            raise ValueError(
                f"initial_state must be fp32 [{N}, {HV}, {K}, {V}], "
                f"got {initial_state.dtype} {list(initial_state.shape)}")
    return DeltaShapes(T, N, H, HV, K, V)


def seq_bounds(cu_seqlens: torch.Tensor | None, T: int) -> list[int]:
    """cu_seqlens as a Python list ([0, T] when None); ValueError unless it rises from 0 to T."""
    if cu_seqlens is None:
        return [0, T]
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
    return cu


def check_checkpoints(checkpoint_at: torch.Tensor, cu: list[int], chunk: int = CHUNK) -> Checkpoints:
    """Map packed positions p (cu[n] < p <= cu[n+1]; p - cu[n] a multiple of `chunk` or p == cu[n+1])
    to (n, p - cu[n]); raise ValueError on any other position."""
    if checkpoint_at.dim() != 1 or checkpoint_at.dtype != torch.int64:
        raise ValueError(
            f"checkpoint_at must be int64 [C], got {checkpoint_at.dtype} {tuple(checkpoint_at.shape)}")
    pos = checkpoint_at.cpu()
    bounds = torch.tensor(cu, dtype=torch.int64)
    seq = torch.searchsorted(bounds, pos, side="left") - 1  # first n with cu[n] < p <= cu[n+1]
    ok = (pos > 0) & (pos <= cu[-1])
    seq = seq.clamp(0, len(cu) - 2)
    length = pos - bounds[seq]
    ok &= (length % chunk == 0) | (pos == bounds[seq + 1])
    if not bool(ok.all()):
        bad = pos[~ok].tolist()
        raise ValueError(
            f"checkpoint_at positions {bad} are not a multiple of {chunk} tokens into a sequence "
            f"nor a sequence end (cu_seqlens={cu})")
    return Checkpoints(seq, length)
