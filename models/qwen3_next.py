"""Qwen3-Next: Gated DeltaNet layers + gated GQA attention layers (partial RoPE), MoE MLPs with a
gated shared expert. Parameter names follow the HF checkpoints; all RMSNorms outside the
GDN output norm are the (1 + w) form."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import native
from kernels.gdn import CHUNK
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers import linear
from models.layers.context_parallel import store_kv
from models.layers.linear import Linear, fused_linear
from models.layers.mlp import GatedMLP, compiled_experts, run_experts
from models.layers.model import CausalLM
from models.layers.norm import GatedRMSNorm, RMSNorm
from models.layers.state import delta_decode, delta_inputs, delta_rule, short_conv
from models.layers.tensor_parallel import column, ffn, heads, row, shard


class GatedDeltaNet(nn.Module):
    """GDN: q/k/v/z and b/a projections, one short conv over the concatenated [q, k, v]
    channels, scalar-gated delta rule, silu(z)-gated output norm. The checkpoint groups the
    projections' rows by key head ([q_h | k_h | v_h | z_h] and [b_h | a_h] for each h); they are
    held as [all q | all k | all v | all z] and [all b | all a] (`from_checkpoint`), so the conv
    input and the gate are column ranges of the projection, not gathered every forward."""

    def __init__(self, cfg, state_idx: int):
        super().__init__()
        h, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hv % h:
            raise ValueError(f"linear_num_value_heads: {hv} is not a multiple of linear_num_key_heads {h}")
        self.h, self.hv, self.dk, self.dv = h, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.checkpoint_heads = h, hv  # the checkpoint's layout (h and hv become a rank's under `shard`)
        self.state_idx = state_idx
        key_dim, value_dim, hid = h * self.dk, hv * self.dv, cfg.hidden_size
        conv_dim = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.in_proj_qkvz = Linear(hid, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = Linear(hid, 2 * hv, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, activation="silu")
        self.out_proj = Linear(value_dim, hid, bias=False)

    def from_checkpoint(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Rows grouped by key head -> grouped by kind (the layout forward reads)."""
        (h, hv), dk, dv = self.checkpoint_heads, self.dk, self.dv
        r = hv // h
        if name == "in_proj_qkvz.weight":
            q, k, v, z = t.view(h, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], 1)
            return torch.cat([part.reshape(-1, t.shape[-1]) for part in (q, k, v, z)])
        if name == "in_proj_ba.weight":
            b, a = t.view(h, 2 * r, -1).split([r, r], 1)
            return torch.cat([b.reshape(-1, t.shape[-1]), a.reshape(-1, t.shape[-1])])
        return t

    def shard(self, tp) -> None:
        """Key heads [r H / N, (r + 1) H / N) and their value heads (models/layers/tensor_parallel.py)."""
        h, hv = self.h, self.hv
        qk = heads(h * self.dk, h, "linear_num_key_heads")
        vz = heads(hv * self.dv, h, "linear_num_key_heads")
        per_v = heads(hv, h, "linear_num_key_heads")
        column(self.in_proj_qkvz, tp, [*qk, *qk, *vz, *vz])
        column(self.in_proj_ba, tp, [*per_v, *per_v])
        shard(self.conv1d.weight, tp, [*qk, *qk, *vz])
        shard(self.dt_bias, tp, per_v)
        shard(self.A_log, tp, per_v)
        row(self.out_proj, tp, vz)
        self.h, self.hv = h // tp.world, hv // tp.world

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        h, hv, dk, dv = self.h, self.hv, self.dk, self.dv
        buf = batch.memory.state[self.state_idx]
        qkvz, ba = fused_linear(x, self.in_proj_qkvz, self.in_proj_ba)
        qkv, z = qkvz.split_with_sizes([2 * h * dk + hv * dv, hv * dv], -1)  # [T, 2*H*K + HV*V], [T, HV*V]
        b, a = ba.view(t, 2, 1, hv).unbind(1)  # [T, 1, HV] each
        w = self.conv1d.weight[:, 0]  # [2*H*K + HV*V, W]
        o = delta_decode(batch, buf, qkv, w, (h, dk, hv, dv), a, self.A_log, self.dt_bias, b, self.norm,
                         z.view(t, hv, dv), x.dtype)
        if o is not None:
            return self.out_proj(o.reshape(t, -1))
        qkv = short_conv(batch, buf["conv"], qkv, w, None)  # read in place: rows of the projection
        # fp32 q, k [T, H, K] l2-normalised, v [T, HV, V], g [T, HV, 1], beta [T, HV]
        q, k, v, g, beta = delta_inputs(qkv, (h, dk, hv, dv), a, self.A_log, self.dt_bias, b)
        o = delta_rule(batch, buf["recurrent"], "gdn", q, k, v, g.view(t, hv), beta)  # [T, HV, V]
        o = self.norm(o, z.view(t, hv, dv), x.dtype)
        return self.out_proj(o.reshape(t, -1))


def rope_cos_sin(batch: ForwardBatch, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim] fp32 at batch.positions (rotate-half layout), computed once per batch."""
    key = ("rope", dim, theta)
    if key not in batch.extras:
        pos = batch.positions
        inv_freq = theta ** -(torch.arange(0, dim, 2, device=pos.device, dtype=torch.float) / dim)  # [dim/2]
        freqs = pos.float()[:, None] * inv_freq  # [T, dim/2]
        emb = torch.cat([freqs, freqs], -1)  # [T, dim]
        batch.extras[key] = (emb.cos(), emb.sin())
    return batch.extras[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [T, H, D] (rotate-half pairs); the rest pass."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim].float(), x[..., dim:]
    x1, x2 = rot.chunk(2, -1)
    rot = rot * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]
    return torch.cat([rot.to(x.dtype), rest], -1)


class GatedAttention(nn.Module):
    """GQA with per-head (1 + w) q/k norms, partial RoPE, and a sigmoid output gate that
    q_proj emits beside the queries (per head: [q | gate] in the checkpoint; held as
    [all q | all gate] by `from_checkpoint`, so the gate is a column range, not a copy)."""

    def __init__(self, cfg, kv_idx: int):
        super().__init__()
        hid, h, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or hid // h
        rope = cfg.rope_parameters
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters: rope_type {rope['rope_type']!r} is not supported; supported: default")
        self.h, self.hkv, self.d, self.kv_idx = h, hkv, d, kv_idx
        self.checkpoint_heads = h  # the checkpoint's layout (h becomes a rank's under `shard`)
        self.rot, self.theta = int(d * rope.get("partial_rotary_factor", 1.0)), float(rope["rope_theta"])
        bias = cfg.attention_bias
        self.q_proj = Linear(hid, h * d * 2, bias=bias)
        self.k_proj = Linear(hid, hkv * d, bias=bias)
        self.v_proj = Linear(hid, hkv * d, bias=bias)
        self.o_proj = Linear(h * d, hid, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, offset=1.0)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, offset=1.0)

    def from_checkpoint(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """q_proj rows (and bias) per head [q | gate] -> [all q | all gate]."""
        if name in ("q_proj.weight", "q_proj.bias"):
            return t.view(self.checkpoint_heads, 2, self.d, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return t

    def shard(self, tp) -> None:
        q = heads(self.h * self.d, self.h, "num_attention_heads")
        kv = heads(self.hkv * self.d, self.hkv, "num_key_value_heads")
        column(self.q_proj, tp, [*q, *q])  # [all q | all gate]
        column(self.k_proj, tp, kv)
        column(self.v_proj, tp, kv)
        row(self.o_proj, tp, q)
        self.h, self.hkv = self.h // tp.world, self.hkv // tp.world

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = fused_linear(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = q.view(t, 2, self.h, self.d).unbind(1)  # [T, H, D] each
        k, v = k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)  # [T, Hkv, D]
        cos, sin = rope_cos_sin(batch, self.rot, self.theta)
        caches = batch.memory.kv[self.kv_idx]  # name -> [num_pages, page_size, Hkv, D]
        if batch.fused_decode:  # the steps below in one compiled call (the same bits)
            o = native.attention_decode(q, k, v, caches["k"], caches["v"], batch.kv_slots, batch.page_table,
                                        batch.seq_lens, self.d**-0.5, gate, (self.q_norm, self.k_norm), cos, sin)
            if o is not None:
                return self.o_proj(o)
        q, k = self.norm_rope(q, self.q_norm, cos, sin), self.norm_rope(k, self.k_norm, cos, sin)
        store_kv(batch, caches["k"], caches["v"], k, v)
        attn = kernels.get("attention", x.device)
        o = attn(q, caches["k"], caches["v"], batch.page_table, batch.cu_seqlens, batch.seq_lens,
                 self.d**-0.5)  # [T, H, D]
        o, gate = o.reshape(t, -1), gate.reshape(t, -1)
        gated = native.sigmoid_gate(o, gate)  # one pass on CPU
        return self.o_proj(o * torch.sigmoid(gate) if gated is None else gated)

    @staticmethod
    def norm_rope(x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """norm(x), then RoPE: one compiled pass on CPU (kernels/native.py), else the torch ops."""
        y = native.rms_norm_rope(x, norm.weight, norm.eps, norm.offset, cos, sin)
        return apply_rope(norm(x), cos, sin) if y is None else y


class SparseMoE(nn.Module):
    """Softmax top-k routing (optionally renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, cfg):
        super().__init__()
        hid, act = cfg.hidden_size, cfg.hidden_act
        self.top_k, self.renorm = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(hid, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hid, cfg.moe_intermediate_size, act) for _ in range(cfg.num_experts))
        self.shared_expert = GatedMLP(hid, cfg.shared_expert_intermediate_size, act)
        self.shared_expert_gate = Linear(hid, 1, bias=False)

    def shard(self, tp) -> None:
        for expert in (*self.experts, self.shared_expert):
            ffn(expert, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        se = self.shared_expert
        compiled = compiled_experts(x, self.experts, se) if linear.ENABLED else None
        if compiled is not None:  # the steps below in one compiled call (the same bits)
            (stacks, own), router = compiled, linear.fuse((self.gate, self.shared_expert_gate))
            out = None if router.bias is not None else native.softmax_moe(
                x, router.weight, self.top_k, self.renorm, stacks.gate_up, stacks.down, own)
            if out is not None:
                return out
        logits, shared_gate = fused_linear(x, self.gate, self.shared_expert_gate)
        routed = native.topk_softmax(logits, self.top_k, self.renorm)
        if routed is None:
            probs = F.softmax(logits, -1, dtype=torch.float)  # [T, E]
            routed = probs.topk(self.top_k, -1)
            if self.renorm:
                routed = (routed[0] / routed[0].sum(-1, keepdim=True), routed[1])
        w, idx = routed  # [T, top_k] each
        return run_experts(x, self.experts, idx, w.to(x.dtype), shared=se, scale=torch.sigmoid(shared_gate))


def is_sparse(hf, i: int) -> bool:
    return i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0


class Qwen3NextBlock(nn.Module):
    def __init__(self, cfg, i: int, mixer_idx: int):
        super().__init__()
        if cfg.layer_types[i] == "full_attention":
            self.self_attn = GatedAttention(cfg, mixer_idx)
        else:
            self.linear_attn = GatedDeltaNet(cfg, mixer_idx)
        if is_sparse(cfg, i):
            self.mlp: nn.Module = SparseMoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        mixer = self.self_attn if hasattr(self, "self_attn") else self.linear_attn
        h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(mixer(h, batch), residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(CausalLM):
    keep_fp32 = ("dt_bias", "A_log")
    ignore_prefixes = ("mtp.",)
    norm_offset = 1.0

    def __init__(self, hf):
        if hf.hidden_act != "silu":
            raise ValueError(f"hidden_act: {hf.hidden_act!r} is not supported (the GDN conv and MLPs use silu)")
        super().__init__(hf, Qwen3NextBlock, hf.rms_norm_eps)

    @staticmethod
    def layer_kinds(hf) -> tuple[str, ...]:
        kinds = {"full_attention": "attn", "linear_attention": "gdn"}
        bad = sorted(set(hf.layer_types) - set(kinds))
        if bad:
            raise ValueError(f"layer_types: unknown type(s) {bad}; known: {sorted(kinds)}")
        return tuple(kinds[t] for t in hf.layer_types)

    @classmethod
    def model_config(cls, hf, dtype: torch.dtype) -> ModelConfig:
        hkv, hv = hf.num_key_value_heads, hf.linear_num_value_heads
        d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        dk, dv = hf.linear_key_head_dim, hf.linear_value_head_dim
        conv_dim = 2 * hf.linear_num_key_heads * dk + hv * dv
        return ModelConfig.uniform(
            hf, cls.layer_kinds(hf),
            kv={"k": (hkv, d), "v": (hkv, d)},
            state={"recurrent": ((hv, dk, dv), torch.float32),
                   "conv": ((conv_dim, hf.linear_conv_kernel_dim - 1), dtype)},
            kernel_chunks={"gdn": CHUNK},
            dtype=dtype,
        )
