"""Causal conv1d on CUDA through the `causal_conv1d` package (imported on first call).

causal_conv1d_fn takes `initial_states` and returns final states only without `seq_idx`
(one state per batch row), so packed varlen with per-sequence states is done on the
extended tensor of kernels.conv1d.torch instead: each sequence's state rows precede its
tokens, no window crosses a sequence, and one kernel call covers the whole batch.
Widths the kernel lacks (W > 4) take the torch path on the same device.
"""
from __future__ import annotations

import torch

from kernels.conv1d.torch import causal_conv1d, causal_conv1d_update, check_conv_args, extend, finish

MAX_WIDTH = 4  # causal_conv1d kernels support 2 <= W <= 4


def cuda_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
    checkpoint_at: torch.Tensor | None = None,
):
    """Same contract as `kernels.conv1d.torch.causal_conv1d`; y is computed in x's dtype."""
    check_conv_args(x, weight, bias, activation)
    D, W = weight.shape
    if W > MAX_WIDTH:
        return causal_conv1d(x, weight, bias, conv_state, cu_seqlens, activation, checkpoint_at)
    from causal_conv1d import causal_conv1d_fn

    ext = extend(x, conv_state, cu_seqlens, W, x.dtype)
    rows = ext.rows.T[None]  # [1, D, T'] channel-last view
    if D % 8:
        rows = rows.contiguous()  # the channel-last kernel needs D % 8 == 0
    b = None if bias is None else bias.to(weight.dtype)
    out = causal_conv1d_fn(rows, weight, b, activation=activation)  # [1, D, T']
    y = out[0].T.index_select(0, ext.token_row)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    return finish(ext, y, W, state_dtype, checkpoint_at)


def cuda_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
):
    """Same contract as `causal_conv1d_update`: conv_state is read only; the kernel
    updates a copy in x's dtype, returned in conv_state's dtype."""
    check_conv_args(x, weight, bias, activation)
    if weight.shape[1] > MAX_WIDTH:
        return causal_conv1d_update(x, weight, bias, conv_state, activation)
    from causal_conv1d import causal_conv1d_update as kernel_update

    state = conv_state.to(dtype=x.dtype, copy=True)
    b = None if bias is None else bias.to(weight.dtype)
    y = kernel_update(x, state, weight, b, activation)
    return y, state.to(conv_state.dtype)
