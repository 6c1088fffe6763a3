"""Feed-forward blocks: gated MLP and a mixture of experts with per-expert weights."""
from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from models.layers.linear import Linear, fuse, fused_linear
from models.layers.tensor_parallel import ffn


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2: on CPU in one compiled pass (the same bits), else squared in place after relu."""
    y = native.relu2(x)
    return F.relu(x).square_() if y is None else y


ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "relu2": relu2, "gelu": F.gelu}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); names follow HF checkpoints (gate_proj/up_proj/down_proj)."""

    def __init__(self, hidden: int, inter: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.act = ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(*fused_linear(x, self.gate_proj, self.up_proj))

    def finish(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """down(act(gate) * up) from gate_proj(x), up_proj(x) computed by the caller (which may
        fuse them with other projections of x)."""
        return self.down_proj(self.act(gate) * up)

    def parts(self):
        return self.gate_proj, self.up_proj, self.down_proj, self.act

    def shard(self, tp) -> None:
        ffn(self, tp)


class Stacked(NamedTuple):
    """The experts' weights as [E, out, in] stacks and biases as [E, 1, out] (None where the
    experts have none); each expert's parameters are views of one row, so there is one copy.
    Gated experts without biases keep gate and up in one [E, 2 * inter, in] stack (`gate_up`,
    of which `gate` and `up` are the halves), so both projections are one batched matmul."""

    gate_up: torch.Tensor | None
    gate: torch.Tensor | None
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]


PAD_FREE_ROWS = 64  # at most this many rows per expert: the padded path, however skewed
STACKS: weakref.WeakKeyDictionary[nn.ModuleList, Stacked] = weakref.WeakKeyDictionary()


def _stack(linears, attr: str) -> torch.Tensor | None:
    """Stack one parameter of every Linear (None if absent) and make each a view of its row."""
    if linears[0] is None or getattr(linears[0], attr) is None:
        return None
    stack = torch.stack([getattr(lin, attr).data for lin in linears])
    for e, lin in enumerate(linears):
        getattr(lin, attr).data = stack[e]
    return stack


def stack_experts(experts: nn.ModuleList) -> Stacked:
    """Stack the weights of experts that expose `parts()` -> (gate Linear or None, up Linear,
    down Linear, activation), once per module list (inference weights never change)."""
    if experts not in STACKS:
        gate, up, down, acts = zip(*(e.parts() for e in experts))  # type: ignore[operator]
        if len(set(acts)) != 1:
            raise ValueError(f"experts: one activation expected, got {len(set(acts))}")
        g, u, d = (_stack(linears, "weight") for linears in (gate, up, down))
        gb, ub, db = (_stack(linears, "bias") for linears in (gate, up, down))
        assert u is not None and d is not None
        gb, ub, db = (b if b is None else b[:, None] for b in (gb, ub, db))
        gu = None
        if g is not None and gb is None and ub is None:  # one stack, the experts' weights views of its rows
            gu, inter = torch.cat([g, u], 1), g.shape[1]
            for e, (lg, lu) in enumerate(zip(gate, up)):
                lg.weight.data, lu.weight.data = gu[e, :inter], gu[e, inter:]
            g, u = gu[:, :inter], gu[:, inter:]
        STACKS[experts] = Stacked(gu, g, u, d, gb, ub, db, acts[0])
    return STACKS[experts]


def _bmm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [E, C, in] @ w[e].T (+ b[e]) -> [E, C, out]."""
    return torch.bmm(x, w.transpose(1, 2)) if b is None else torch.baddbmm(b, x, w.transpose(1, 2))


def run_experts(x: torch.Tensor, experts: nn.ModuleList, idx: torch.Tensor, weight: torch.Tensor,
                shared: GatedMLP | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weight[t, k] * experts[idx[t, k]](x[t]) for x [T, D], idx/weight [T, top_k]; with a
    `shared` expert that sum + shared(x) (times `scale` [T, 1] where given: a gated shared
    expert), each term rounded as torch's ops round them.

    When the busiest expert's rows times the expert count is at most twice the T * top_k
    (token, choice) rows (balanced routing), or no expert has more than PAD_FREE_ROWS rows
    (decode batches: there a block's matmul costs its call, not its rows), the rows are copied
    into zero-padded per-expert blocks and all experts run as one batched matmul per
    projection; otherwise the rows are sorted by expert and each chosen expert runs once on its contiguous
    block. The outputs are read back in (token, choice) order and summed over the choices (no
    scatter-add). On CPU the compiled routing of kernels/native.py does the padded path's
    copies in one pass each, with the same results; on CPUs with the packed micro-kernels,
    gated silu experts without biases run as one compiled call instead (each expert on its own
    rows, no padding), the shared expert with them: in bf16 with the same roundings, in fp32
    within fp32 rounding (its matmuls sum in their own order).
    """
    compiled = compiled_experts(x, experts, shared)
    if compiled is not None:
        w, own = compiled
        out = native.moe(x, idx, weight, w.gate_up, w.down, "silu", own, scale)
        if out is not None:
            return out
    out = _run_experts(x, experts, idx, weight)
    if shared is None:
        return out
    return out + (shared(x) if scale is None else scale * shared(x))


def compiled_experts(x: torch.Tensor, experts: nn.ModuleList, shared: GatedMLP | None = None) -> \
        tuple[Stacked, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """(the experts' stacks, the shared expert's weights or None) where the compiled experts call
    (kernels/native.py moe) can run them on x: gated silu experts without biases exposing parts(),
    such a shared expert if there is one, and the kernels built for x's dtype; else None."""
    if not (hasattr(experts[0], "parts") and native.moe_runs(x)):
        return None
    w = stack_experts(experts)
    own = None if shared is None else _shared_weights(shared)
    if w.gate_up is None or w.act is not ACTS["silu"] or (shared is not None and own is None):
        return None
    return w, own


def _shared_weights(shared: GatedMLP) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A silu GatedMLP's (gate_up [2I, D], down [D, I]) for the compiled experts call (gate and up
    one stack, as fused_linear keeps them), or None where it has biases or another activation."""
    gate, up, down, act = shared.parts()
    if act is not ACTS["silu"] or any(lin.bias is not None for lin in (gate, up, down)):
        return None
    return fuse((gate, up)).weight, down.weight


def _run_experts(x: torch.Tensor, experts: nn.ModuleList, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    t, k = idx.shape
    flat = idx.flatten()
    counts = torch.bincount(flat, minlength=len(experts))  # [E]
    cap = int(counts.max())
    if (len(experts) * cap <= 2 * t * k or cap <= PAD_FREE_ROWS) and hasattr(experts[0], "parts"):
        w = stack_experts(experts)
        padded, at = _dispatch(x, idx, counts, cap)  # [E, cap, D]; [T * top_k] row of each (token, choice)
        if w.gate_up is not None:
            gate, up = _bmm(padded, w.gate_up, None).chunk(2, -1)
            h = w.act(gate) * up
        else:
            up = _bmm(padded, w.up, w.up_bias)
            h = w.act(up) if w.gate is None else w.act(_bmm(padded, w.gate, w.gate_bias)) * up
        return _combine(_bmm(h, w.down, w.down_bias).flatten(0, 1), at, weight.to(x.dtype))
    order = flat.argsort(stable=True)  # [T * top_k] rows grouped by expert
    rows = x[order // k]  # [T * top_k, D] in expert order
    y = torch.cat([experts[e](r) for e, r in enumerate(rows.split(counts.tolist())) if len(r)])
    y = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)  # back to (token, choice) order
    return (y * weight[..., None].to(x.dtype)).sum(1)


def _dispatch(x: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded [E, cap, D]: expert e's rows in (token, choice) order, then zeros; at [T * top_k]:
    the row of padded.view(E * cap, D) that each (token, choice) went to)."""
    routed = native.moe_dispatch(x, idx, counts, cap)
    if routed is not None:
        return routed
    flat, k = idx.flatten(), idx.shape[1]
    order = flat.argsort(stable=True)  # rows grouped by expert, (token, choice) order within
    expert = flat[order]
    rank = torch.arange(len(flat), device=x.device) - (counts.cumsum(0) - counts)[expert]
    at = torch.empty_like(order).index_copy_(0, order, expert * cap + rank)
    padded = x.new_zeros(len(counts) * cap, x.shape[1]).index_copy_(0, at, x.repeat_interleave(k, 0))
    return padded.view(len(counts), cap, -1), at


def _combine(y: torch.Tensor, at: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum over c of weight[t, c] * y[at[t * top_k + c]] for y [R, D], weight [T, top_k]."""
    out = native.moe_combine(y, at, weight)
    if out is not None:
        return out
    t, k = weight.shape
    return (y.index_select(0, at).view(t, k, -1) * weight[..., None]).sum(1)


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
        logits = native.router_logits(x, self.weight)
        scores = (F.linear(x.float(), self.weight.float()) if logits is None else logits).sigmoid()  # [T, E]
        if self.groups == 1:
            routed = native.topk_scores(scores, self.e_score_correction_bias, self.top_k, self.renorm, self.scaling)
            if routed is not None:
                return routed[1], routed[0]
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
