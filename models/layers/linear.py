"""Linears: bf16 on CPU through packed micro-kernels, and linears that read the same input
run as one matmul.

`linear` is F.linear, except for bf16 on CPUs with the compiled bf16 micro-kernels
(kernels/gemm/cpu_gemm.cpp: oneDNN's with AMX, its own with AVX-512 BF16 or AVX2). With AMX,
torch's matmul builds a oneDNN primitive for every new row count (3-6 ms at prefill sizes, and
every round has another) and costs 25-50 us at decode sizes: there each weight is packed once
and multiplied in 4-10 us at decode sizes, with the same bits (fp32 sums rounded once to bf16).
Elsewhere our own micro-kernels run (`vdpbf16ps` with AVX-512 BF16, 2.5x the AVX2 one's speed;
with AVX2 only, where torch's bf16 matmul has no vector kernel, 4-9x torch's), their outputs
within a bf16 step of torch's (fp32 sums in their own order, rounded once). fp32 runs through
an fp32 micro-kernel of the same drivers on AVX-512 BF16 CPUs without AMX (AMD Zen 4), where
it takes 0.6-0.9x the time of torch's (MKL's) sgemm, and on AVX2 CPUs without AVX-512 (AMD Zen
3), where NemotronH's whole fp32 runs took 0.93-0.97x the time (docs/kernels.md); elsewhere fp32
is F.linear.
`Linear` is nn.Linear running `linear`; the models build their projections from it.

At decode sizes a matmul's fixed cost (dispatch, oneDNN's primitive lookup) outweighs its
arithmetic: a [64, 256] x [256, 8] bf16 matmul takes about half as long as one with 256
outputs, for 1/32 of the arithmetic (benchmarks/fused_projections.py). So
projections of one input (a block's q/k/v, a router beside a shared expert's gate and up)
are one F.linear over their weights stacked by rows. On first use each Linear's weight (and
bias) becomes a view of its rows of the stack, so there is still one copy of the weights.
Each output column is the same dot product as before: bf16 outputs are bitwise those of
the separate calls; fp32 outputs of very narrow projections (N <= 8) can differ in the last
bit, where BLAS picks another kernel for a narrow matrix than for a wide one.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the packed bf16 or fp32 micro-kernels where they run."""
    out = (native.linear_f32 if x.dtype == torch.float32 else native.linear_bf16)(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Fused(NamedTuple):
    linears: tuple[nn.Linear, ...]
    weight: torch.Tensor  # [sum of outs, in]
    bias: torch.Tensor | None
    sizes: list[int]


FUSED: weakref.WeakKeyDictionary[nn.Linear, Fused] = weakref.WeakKeyDictionary()
ENABLED = True  # False: separate calls, for comparison (benchmarks/fused_projections.py)


def fuse(linears: tuple[nn.Linear, ...]) -> Fused:
    """The stack of `linears` (keyed by the first), built once; rebuilt if the weights were
    replaced since (a `.to()` of the module makes new tensors, no longer views of the stack).
    Where some have a bias and others not, the stack's bias holds zeros for the others."""
    f = FUSED.get(linears[0])
    if f is not None and f.linears == linears and linears[0].weight.data_ptr() == f.weight.data_ptr():
        return f
    if len({(lin.in_features, lin.weight.dtype, lin.weight.device) for lin in linears}) != 1:
        raise ValueError("fused_linear: the linears must share in_features, dtype and device")
    sizes = [lin.out_features for lin in linears]
    weight = stacked([lin.weight for lin in linears])
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([weight.new_zeros(n) if lin.bias is None else lin.bias.data for lin, n in zip(linears, sizes)])
        for lin, b in zip(linears, bias.split(sizes)):
            if lin.bias is not None:
                lin.bias.data = b
    FUSED[linears[0]] = f = Fused(linears, weight, bias, sizes)
    return f


def stacked(params: list[torch.Tensor]) -> torch.Tensor:
    """params (one trailing shape, dtype and device) as one tensor stacked along dim 0: a view
    where they are already consecutive rows of one storage (e.g. experts' gate and up in
    stack_experts); else the stack is made once and each parameter's data becomes a view of its
    rows (one copy of the weights, and every later call a view)."""
    data = [p.data for p in params]
    if adjacent(data):
        return data[0].as_strided((sum(d.shape[0] for d in data), *data[0].shape[1:]), data[0].stride())
    stack = torch.cat(data)
    for p, rows in zip(params, stack.split([d.shape[0] for d in data])):
        p.data = rows
    return stack


def adjacent(ts: list[torch.Tensor]) -> bool:
    """Contiguous tensors that follow one another in one storage."""
    ok = all(t.is_contiguous() and t.untyped_storage().data_ptr() == ts[0].untyped_storage().data_ptr() for t in ts)
    return ok and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(ts, ts[1:]))


def fused_linear(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(linears[0](x), linears[1](x), ...) from one matmul; each output a view of its columns."""
    if not ENABLED:
        return tuple(lin(x) for lin in linears)
    f = fuse(linears)
    return linear(x, f.weight, f.bias).split_with_sizes(f.sizes, -1)  # not split(): its Python wrapper costs 2 us


def joined(*parts: torch.Tensor) -> torch.Tensor:
    """parts [T, n_i] side by side as one [T, sum n_i]: a view where they are consecutive column
    ranges of one tensor (outputs of fused_linear), else a copy (torch.cat)."""
    a = parts[0]
    same = all(p.dim() == 2 and p.stride() == a.stride() and p.shape[0] == a.shape[0] and
               p.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for p in parts)
    if same and a.stride(1) == 1 and all(b.storage_offset() == p.storage_offset() + p.shape[1]
                                         for p, b in zip(parts, parts[1:])):
        return a.as_strided((a.shape[0], sum(p.shape[1] for p in parts)), a.stride(), a.storage_offset())
    return torch.cat(parts, -1)
