"""Feed-forward blocks: gated MLP and a mixture of experts with per-expert weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTS = {"silu": F.silu, "relu2": lambda x: F.relu(x).square(), "gelu": F.gelu}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); names follow HF checkpoints (gate_proj/up_proj/down_proj)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def run_experts(x: torch.Tensor, experts: nn.ModuleList, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_k weight[t, k] * experts[idx[t, k]](x[t]) for x [T, D], idx/weight [T, top_k].

    Loops over the experts that were chosen at least once; each runs on its tokens only.
    """
    out = torch.zeros_like(x)
    flat = idx.flatten()  # [T * top_k]
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tokens = order // idx.shape[1]
    w = weight.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            t = tokens[start : start + n]
            y = experts[e](x[t]) * w[start : start + n, None].to(x.dtype)
            out.index_add_(0, t, y)
        start += n
    return out
