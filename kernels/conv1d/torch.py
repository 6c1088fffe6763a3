"""Causal depthwise conv1d with a conv state over packed varlen input (torch path).

The conv state of a sequence is the W-1 inputs before its current position, oldest first.
Both paths work on an *extended* packed tensor in which every sequence is preceded by its
initial conv state, so no window ever reaches into the previous sequence:

    ext = [state_0 (W-1 rows), tokens of seq 0, state_1 (W-1 rows), tokens of seq 1, ...]

Token t of sequence n sits at ext row t + (n+1)(W-1); the conv state at packed position p
of sequence n is ext rows [p + n(W-1), p + (n+1)(W-1)).

Where the compiled CPU kernels are built (kernels/native.py), the prefill runs in
conv1d/cpu_conv.cpp instead (the same windows read in place, no extended copy).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import native
from kernels.mamba2.varlen import locate_checkpoints, seq_bounds

ACTIVATIONS = (None, "silu")


class Extended(NamedTuple):
    """Packed input with each sequence's conv state in front of it."""

    rows: torch.Tensor  # [T + N(W-1), D]
    token_row: torch.Tensor  # [T] int64, ext row of each packed token
    cu: torch.Tensor  # [N+1] int64, the packed cu_seqlens


def extend(x, conv_state, cu_seqlens, width: int, dtype: torch.dtype) -> Extended:
    """Build `ext` (see module docstring) in `dtype`; conv_state None means zeros."""
    T, D = x.shape
    cu = seq_bounds(cu_seqlens, T, x.device)
    N, tail = cu.numel() - 1, width - 1
    if conv_state is not None and conv_state.shape != (N, D, tail):
        raise ValueError(f"conv_state must be [N, D, W-1] = {(N, D, tail)}, got {tuple(conv_state.shape)}")
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), cu[1:] - cu[:-1])  # [T]
    token_row = torch.arange(T, device=x.device) + (seq + 1) * tail
    state_row = (cu[:-1] + torch.arange(N, device=x.device) * tail)[:, None] + torch.arange(tail, device=x.device)
    rows = x.new_zeros(T + N * tail, D, dtype=dtype)
    rows.index_copy_(0, token_row, x.to(dtype))
    if conv_state is not None:
        rows.index_copy_(0, state_row.reshape(-1), conv_state.transpose(1, 2).reshape(-1, D).to(dtype))
    return Extended(rows, token_row, cu)


def states_at(ext: Extended, seq: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
    """Conv states [len(pos), D, W-1] before packed positions pos of sequences seq."""
    first = pos + seq * (width - 1)
    index = (first[:, None] + torch.arange(width - 1, device=pos.device)).reshape(-1)  # [len(pos) * (W-1)]
    return ext.rows.index_select(0, index).view(len(pos), width - 1, -1).transpose(1, 2)


def check_conv_args(x, weight, bias, activation):
    """ValueError naming the first argument that does not fit x [T, D]."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D, W] with D={x.shape[1]}, W >= 2, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias must be [D] = {(x.shape[1],)} or None, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def finish(ext: Extended, y, width, state_dtype, checkpoint_at):
    """(y, final_state) or (y, final_state, states): the returns shared by both paths."""
    N = ext.cu.numel() - 1
    final = states_at(ext, torch.arange(N, device=y.device), ext.cu[1:], width).to(state_dtype)
    if checkpoint_at is None:
        return y, final
    where = locate_checkpoints(checkpoint_at, ext.cu)
    return y, final, states_at(ext, where.seq, ext.cu[where.seq] + where.offset, width).to(state_dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_at: torch.Tensor | None = None,
):
    """y_t = act(bias + sum_w weight[:, w] * u_{t-W+1+w}), u = the sequence's inputs after its state.

    x [T, D]; weight [D, W]; bias [D] or None; conv_state [N, D, W-1] or None (zeros), read
    only; cu_seqlens [N+1] int64 or None (one sequence); activation "silu" or None;
    checkpoint_at [C] packed positions p with cu[n] < p <= cu[n+1] (any offset).
    Computation is fp32. Returns (y [T, D] in x.dtype, final_state [N, D, W-1]) plus
    states [C, D, W-1] with checkpoint_at; states are in conv_state's dtype (x's if None).
    """
    check_conv_args(x, weight, bias, activation)
    compiled = _compiled(x, weight, bias, conv_state, cu_seqlens, activation, checkpoint_at)
    if compiled is not None:
        return compiled
    W = weight.shape[1]
    ext = extend(x, conv_state, cu_seqlens, W, torch.float32)
    w = weight.float()
    taps = ext.rows.shape[0] - (W - 1)  # windows that fit in ext; window r ends at row r + W-1
    y = ext.rows[:taps] * w[:, 0]  # [taps, D]
    for k in range(1, W):
        y.addcmul_(ext.rows[k : taps + k], w[:, k])
    y = y.index_select(0, ext.token_row - (W - 1))  # [T, D]
    if bias is not None:
        y += bias.float()
    if activation == "silu":
        y = F.silu(y)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    return finish(ext, y.to(x.dtype), W, state_dtype, checkpoint_at)


def _compiled(x, weight, bias, conv_state, cu_seqlens, activation, checkpoint_at):
    """causal_conv1d's returns from the compiled kernel, or None where it is not built."""
    T, D = x.shape
    W = weight.shape[1]
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    if conv_state is not None and conv_state.shape != (N, D, W - 1):
        raise ValueError(f"conv_state must be [N, D, W-1] = {(N, D, W - 1)}, got {tuple(conv_state.shape)}")
    state = (x.new_zeros(N, D, W - 1, dtype=torch.float32) if conv_state is None
             else conv_state.float().contiguous())
    out = native.causal_conv1d(x, weight, bias, state, cu, _checkpoint_rows(checkpoint_at, cu), activation == "silu")
    if out is None:
        return None
    y, states = out
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    final = states[:N].to(state_dtype)
    return (y, final) if checkpoint_at is None else (y, final, states[N:].to(state_dtype))


def conv_in_place(x, weight, bias, activation, state, slots, fresh, cu_seqlens, checkpoint_at=None,
                  checkpoint_slots=None, out=None):
    """causal_conv1d with each sequence's conv state a row of a pool, through the compiled kernel:
    state [P, D, W-1] (fp32 or bf16), sequence n's initial state in row slots[n] (zeros where
    fresh[n]) advanced there in place to its final state, the state after each position of
    checkpoint_at written into row checkpoint_slots[i]. Returns y [T, D] in x's dtype (written into
    `out` where given: contiguous, of y's shape and dtype), or None where the kernel does not run
    (nothing is written then)."""
    check_conv_args(x, weight, bias, activation)
    cu = seq_bounds(cu_seqlens, x.shape[0], x.device)
    at = native.EMPTY if checkpoint_at is None else checkpoint_slots
    return native.causal_conv1d_slots(x, weight, bias, state, slots, fresh, cu, _checkpoint_rows(checkpoint_at, cu),
                                      at, activation == "silu", native.out_rows(out, x.shape, x.dtype))


def _checkpoint_rows(checkpoint_at, cu: torch.Tensor) -> torch.Tensor:
    """The compiled kernels' [C, 2] int64 rows (sequence, tokens of it consumed) of checkpoint_at
    (empty for None)."""
    if checkpoint_at is None:
        return torch.zeros(0, 2, dtype=torch.int64)
    where = locate_checkpoints(checkpoint_at, cu)
    return torch.stack([where.seq, where.offset], dim=1)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
):
    """One decode step per sequence: x [N, D], conv_state [N, D, W-1] (read only).

    Returns (y [N, D] in x.dtype, new_conv_state [N, D, W-1] in conv_state's dtype).
    """
    check_conv_args(x, weight, bias, activation)
    N, D = x.shape
    want = (N, D, weight.shape[1] - 1)
    if conv_state.shape != want:
        raise ValueError(f"conv_state must be [N, D, W-1] = {want}, got {tuple(conv_state.shape)}")
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=-1)  # [N, D, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    return y.to(x.dtype), window[:, :, 1:].to(conv_state.dtype)
