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


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3-style routing (Kimi Linear, NemotronH): sigmoid scores + a correction bias
    choose the experts (top-k within the top groups); weights are the raw scores, optionally
    renormalised, times routed_scaling_factor. Returns (expert ids, weights), both [T, top_k]."""

    e_score_correction_bias: torch.Tensor  # [E], a buffer

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_local_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_local_experts))
        self.top_k, self.groups, self.topk_groups = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.renorm, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.groups > 1:
            grouped = choice.view(x.shape[0], self.groups, -1)
            top_groups = grouped.topk(2, -1)[0].sum(-1).topk(self.topk_groups, -1)[1]  # [T, topk_groups]
            keep = torch.zeros_like(grouped[..., 0]).scatter_(1, top_groups, 1).bool()
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        idx = choice.topk(self.top_k, -1)[1]  # [T, top_k]
        w = scores.gather(1, idx)
        if self.renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling
