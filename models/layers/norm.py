"""RMS norms in the fp32 form the reference models use; on CPU one compiled pass per row
(kernels/native.py), the torch formulation elsewhere."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native

GATE_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in fp32; `offset` = 1 for (1 + w) checkpoints (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.offset or self.weight.dtype == dtype:  # else the product below promotes
            y = native.rms_norm(x, self.weight, self.eps, self.offset, cast_first=not self.offset)
            if y is not None:
                return y
        x = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(s), s) for the residual stream s = x + residual (x when residual is None), the add
        and the norm in one pass where the compiled kernel runs (the same bits)."""
        if residual is None:
            return self(x), x
        if self.offset or self.weight.dtype == x.dtype:
            out = native.add_rms_norm(x, residual, self.weight, self.eps, self.offset, cast_first=not self.offset)
            if out is not None:
                return out
        s = x + residual
        return self(s), s


class GatedRMSNorm(nn.Module):
    """y = w * norm(x) * act(gate), all in fp32 (the output norm of KDA / GDN layers)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.activation = eps, activation
        self.act = GATE_ACTS[activation]

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """In `dtype` (default x's): one rounding of the fp32 result."""
        dtype = x.dtype if dtype is None else dtype
        y = native.rms_norm(x, self.weight, self.eps, gate=gate, act=self.activation, dtype=dtype)
        if y is not None:
            return y
        x = F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps)
        return (x * self.act(gate.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (FLA's convention)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)
