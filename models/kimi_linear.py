"""Kimi Linear: KDA layers + MLA (NoPE) layers, MoE MLPs. Parameter names follow the HF checkpoints."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import native
from kernels.attention import PAD_PAGE
from kernels.kda import CHUNK
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers.context_parallel import store_kv
from models.layers.linear import Linear, fused_linear, joined, stacked
from models.layers.mlp import GatedMLP, GroupedTopKRouter, compiled_experts, run_experts
from models.layers.model import CausalLM
from models.layers.norm import GatedRMSNorm, RMSNorm
from models.layers.state import delta_decode, delta_inputs, delta_rule, short_conv
from models.layers.tensor_parallel import column, ffn, heads, row, shard


class KimiDeltaAttention(nn.Module):
    """KDA: short convs on q/k/v, per-channel forget gate, delta rule, gated output norm."""

    def __init__(self, cfg, state_idx: int):
        super().__init__()
        h, d, hid, w = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.h, self.d, self.state_idx = h, d, state_idx
        self.q_proj = Linear(hid, h * d, bias=False)
        self.q_conv1d = nn.Conv1d(h * d, h * d, w, groups=h * d, bias=False)
        self.k_proj = Linear(hid, h * d, bias=False)
        self.k_conv1d = nn.Conv1d(h * d, h * d, w, groups=h * d, bias=False)
        self.v_proj = Linear(hid, h * d, bias=False)
        self.v_conv1d = nn.Conv1d(h * d, h * d, w, groups=h * d, bias=False)
        self.f_a_proj = Linear(hid, d, bias=False)
        self.f_b_proj = Linear(d, h * d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(h * d))
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1))
        self.b_proj = Linear(hid, h, bias=False)
        self.g_a_proj = Linear(hid, d, bias=False)
        self.g_b_proj = Linear(d, h * d, bias=False)
        self.o_norm = GatedRMSNorm(d, eps=cfg.rms_norm_eps, activation="sigmoid")
        self.o_proj = Linear(h * d, hid, bias=False)

    def shard(self, tp) -> None:
        """Heads [r H / N, (r + 1) H / N) (models/layers/tensor_parallel.py)."""
        h, d = self.h, self.d
        hd = heads(h * d, h, "linear_num_heads")
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.f_b_proj, self.g_b_proj):
            column(lin, tp, hd)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            shard(conv.weight, tp, hd)
        shard(self.dt_bias, tp, hd)
        shard(self.A_log, tp, heads(h, h, "linear_num_heads"), dim=2)
        column(self.b_proj, tp, heads(h, h, "linear_num_heads"))
        row(self.o_proj, tp, hd)
        self.h = h // tp.world

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        buf = batch.memory.state[self.state_idx]
        q, k, v, f, b, g = fused_linear(x, self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                        self.g_a_proj)
        qkv = joined(q, k, v)  # [T, 3*H*D], a view of the projection's columns
        w = stacked([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [3*H*D, W]
        t, hd = x.shape[0], (self.h, self.d, self.h, self.d)
        decay_in, gate = self.f_b_proj(f)[:, None], self.g_b_proj(g).view(t, self.h, self.d)
        o = delta_decode(batch, buf, qkv, w, hd, decay_in, self.A_log, self.dt_bias, b[:, None], self.o_norm, gate,
                         x.dtype)  # decode rows only: the steps below in one call; else None
        if o is None:
            qkv = short_conv(batch, buf["conv"], qkv, w, None)
            # fp32 q, k, v [T, H, D] (q, k l2-normalised), decay [T, H, D], beta [T, H]
            q, k, v, decay, beta = delta_inputs(qkv, hd, decay_in, self.A_log, self.dt_bias, b[:, None])
            o = delta_rule(batch, buf["recurrent"], "kda", q, k, v, decay, beta)  # [T, H, D]
            o = self.o_norm(o, gate, x.dtype)
        return self.o_proj(o.reshape(t, -1))


class MLAttention(nn.Module):
    """MLA in serving form: the cache holds [latent | rope key] per token (one head), queries
    are absorbed into the latent space, values are the latent; no RoPE (Kimi's MLA is NoPE)."""

    def __init__(self, cfg, kv_idx: int):
        super().__init__()
        hid, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.kv_idx = h, kv_idx
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.vd, self.r = cfg.v_head_dim, cfg.kv_lora_rank
        qd = h * (self.nope + self.rope)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hid, qd, bias=False)
        else:
            self.q_a_proj = Linear(hid, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)
            self.q_b_proj = Linear(cfg.q_lora_rank, qd, bias=False)
        self.kv_a_proj_with_mqa = Linear(hid, self.r + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, eps=1e-6)
        self.kv_b_proj = Linear(self.r, h * (self.nope + self.vd), bias=False)
        self.o_proj = Linear(h * self.vd, hid, bias=cfg.attention_bias)
        self.scale = (self.nope + self.rope) ** -0.5

    def shard(self, tp) -> None:
        """Heads of the query and absorbed key/value projections; the latent is replicated."""
        h = self.h
        q = heads(h * (self.nope + self.rope), h, "num_attention_heads")
        column(self.q_proj if hasattr(self, "q_proj") else self.q_b_proj, tp, q)
        column(self.kv_b_proj, tp, heads(h * (self.nope + self.vd), h, "num_attention_heads"))
        row(self.o_proj, tp, heads(h * self.vd, h, "num_attention_heads"))
        self.h = h // tp.world

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        lora = not hasattr(self, "q_proj")
        q, kv = fused_linear(x, self.q_a_proj if lora else self.q_proj, self.kv_a_proj_with_mqa)
        q = self.q_b_proj(self.q_a_layernorm(q)) if lora else q
        q = q.reshape(t, self.h, -1)  # [T, H, nope + rope]
        c, k_rope = kv.split_with_sizes([self.r, self.rope], -1)
        cache = batch.memory.kv[self.kv_idx]["kv"]  # [num_pages, page_size, 1, r + rope]
        if batch.fused_decode:  # the steps below in one compiled call (the same bits)
            w, w_uk, w_uv = self.absorbing()
            o = native.mla_decode(q, c, k_rope, self.kv_a_layernorm, cache, batch.kv_slots, batch.page_table,
                                  batch.seq_lens, self.scale, w_uk.transpose(1, 2), w_uv, w)
            if o is not None:
                return self.o_proj(o)
        latent = torch.cat([self.kv_a_layernorm(c), k_rope], -1)  # [T, r + rope]
        store_kv(batch, cache, None, latent[:, None])
        long = self.expanded_segments(batch)
        if long is None:
            return self.o_proj(self.absorbed(q, cache, batch.page_table, batch.cu_seqlens, batch.seq_lens))
        out = q.new_empty(t, self.h * self.vd)
        for segs, form in ((long.nonzero().flatten(), self.expanded), ((~long).nonzero().flatten(), self.absorbed)):
            if segs.numel():
                rows, cu = segment_rows(batch.cu_seqlens, segs)
                out[rows] = form(q[rows], cache, batch.page_table[segs], cu, batch.seq_lens[segs])
        return self.o_proj(out)

    def expanded_segments(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Which segments attend in expanded form ([N] bool), or None for none: the prefill
        segments with enough queries to pay for it, on CPU, without context parallelism. Per key, absorbed
        attention costs H (2r + rope) multiply-adds a query, expanded H (nope + rope + v) plus H r
        (nope + v) once to expand it, so expanding pays from r (nope + v) / (2r - nope - v)
        queries a sequence (128 for the built-in model, 171 for Kimi-Linear-48B). Decode rows stay
        absorbed."""
        saved = 2 * self.r - self.nope - self.vd
        if batch.cp is not None or batch.input_ids.device.type != "cpu" or not batch.num_prefills or saved <= 0:
            return None
        lens = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
        long = lens >= self.r * (self.nope + self.vd) / saved
        long[batch.num_prefills:] = False
        return long if bool(long.any()) else None

    def absorbing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight and its per-head key and value halves, w_uk [H, nope, r] and w_uv
        [H, v, r] (views)."""
        w = self.kv_b_proj.weight
        w_uk, w_uv = w.view(self.h, self.nope + self.vd, self.r).split([self.nope, self.vd], 1)
        return w, w_uk, w_uv

    def absorbed(self, q, cache, page_table, cu_seqlens, seq_lens) -> torch.Tensor:
        """Attention in the latent space: the queries absorbed into it, the latent as values, the
        value up-projection after. q [T, H, nope + rope] -> [T, H * v]."""
        t = q.shape[0]
        q_nope, q_rope = q.split_with_sizes([self.nope, self.rope], -1)  # [T, H, nope], [T, H, rope]
        w, w_uk, w_uv = self.absorbing()
        # the absorbed products per head: bf16 on CPU through the packed micro-kernels (docs/kernels.md:
        # torch's bf16 einsum took 0.8-0.9 ms a call inside a decode step, 4 a step), else einsum
        q_att = q.new_empty(t, self.h, self.r + self.rope)  # [T, H, r + rope]: latent query | rope query
        if not native.heads_bf16(q_nope, w_uk.transpose(1, 2), q_att[..., : self.r], w, "w_uk"):
            q_att[..., : self.r] = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        q_att[..., self.r :] = q_rope
        attn = kernels.get("attention", q.device)
        o = attn(q_att, cache, None, page_table, cu_seqlens, seq_lens, self.scale, v_dim=self.r)  # [T, H, r]
        out = o.new_empty(t, self.h, self.vd)  # [T, H, v]
        if not native.heads_bf16(o, w_uv, out, w, "w_uv"):
            out = torch.einsum("thr,hvr->thv", o, w_uv)
        return out.reshape(t, -1)

    def expanded(self, q, cache, page_table, cu_seqlens, seq_lens) -> torch.Tensor:
        """Attention with per-head keys and values: the latents of the pages the sequences read
        (each page once, however many sequences share it) up-projected into keys [k_nope | k_rope]
        and values, as the reference attention computes them. q [T, H, nope + rope] -> [T, H * v]."""
        page = cache.shape[1]
        used = torch.arange(page_table.shape[1], device=q.device) < (seq_lens[:, None] + page - 1) // page
        pages, local = page_table[used].unique(return_inverse=True)
        lat = cache.index_select(0, pages).view(-1, self.r + self.rope)  # [U * page, r + rope]
        kv = self.kv_b_proj(lat[:, : self.r]).view(len(pages), page, self.h, self.nope + self.vd)
        k = torch.cat([kv[..., : self.nope], lat[:, None, self.r :].expand(-1, self.h, -1).view(
            len(pages), page, self.h, self.rope)], -1)  # [U, page, H, nope + rope]
        v = kv[..., self.nope :]  # [U, page, H, v]: a view (the kernels take strided rows)
        table = torch.full_like(page_table, PAD_PAGE)
        table[used] = local
        attn = kernels.get("attention", q.device)
        return attn(q.contiguous(), k, v, table, cu_seqlens, seq_lens, self.scale).reshape(q.shape[0], -1)


def segment_rows(cu_seqlens: torch.Tensor, segs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed rows of segments `segs` (in order) and their own cu_seqlens."""
    starts, lens = cu_seqlens[segs], cu_seqlens[segs + 1] - cu_seqlens[segs]
    cu = F.pad(lens.cumsum(0), (1, 0))
    return torch.repeat_interleave(starts - cu[:-1], lens) + torch.arange(int(cu[-1]), device=cu.device), cu


class KimiExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = Linear(hidden, inter, bias=False)  # gate
        self.w2 = Linear(inter, hidden, bias=False)  # down
        self.w3 = Linear(hidden, inter, bias=False)  # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def parts(self):
        return self.w1, self.w3, self.w2, F.silu


class KimiMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = GroupedTopKRouter(cfg)
        self.experts = nn.ModuleList(
            KimiExpert(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_local_experts)
        )
        self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def shard(self, tp) -> None:
        for expert in (*self.experts, self.shared_experts):
            ffn(expert, tp)

    def forward(self, x):
        gate = self.gate
        compiled = compiled_experts(x, self.experts, self.shared_experts) if gate.groups == 1 else None
        if compiled is not None:  # the steps below in one compiled call (the same bits)
            stacks, own = compiled
            out = native.scores_moe(x, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.renorm,
                                    gate.scaling, stacks.gate_up, stacks.down, own)
            if out is not None:
                return out
        idx, w = gate(x)
        return run_experts(x, self.experts, idx, w, shared=self.shared_experts)


class KimiBlock(nn.Module):
    def __init__(self, cfg, i: int, mixer_idx: int):
        super().__init__()
        attn = cfg.layer_types[i] == "full_attention"
        self.self_attn = MLAttention(cfg, mixer_idx) if attn else KimiDeltaAttention(cfg, mixer_idx)
        sparse = cfg.mlp_layer_types[i] == "sparse"
        self.block_sparse_moe = KimiMoE(cfg) if sparse else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        h, residual = self.input_layernorm.add(x, residual)
        h, residual = self.post_attention_layernorm.add(self.self_attn(h, batch), residual)
        return self.block_sparse_moe(h), residual


class KimiLinearForCausalLM(CausalLM):
    keep_fp32 = ("e_score_correction_bias", "gate.weight", "dt_bias")

    def __init__(self, hf):
        super().__init__(hf, KimiBlock, hf.rms_norm_eps)

    @staticmethod
    def layer_kinds(hf) -> tuple[str, ...]:
        return tuple("attn" if t == "full_attention" else "kda" for t in hf.layer_types)

    @classmethod
    def model_config(cls, hf, dtype: torch.dtype) -> ModelConfig:
        h, d, w = hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim
        return ModelConfig.uniform(
            hf, cls.layer_kinds(hf),
            kv={"kv": (1, hf.kv_lora_rank + hf.qk_rope_head_dim)},
            state={"recurrent": ((h, d, d), torch.float32), "conv": ((3 * h * d, w - 1), dtype)},
            kernel_chunks={"kda": CHUNK},
            dtype=dtype,
        )
