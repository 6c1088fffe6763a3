"""NemotronH: Mamba2 + GQA attention (NoPE) hybrid; every block is one mixer (Mamba2, attention,
relu2 MLP or MoE) behind a pre-norm. Parameter names follow the HF checkpoints (`backbone.*`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import native
from kernels.mamba2 import chunk_ssd
from kernels.mamba2.chunk import chunk_ssd_in_place
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers import context_parallel
from models.layers.linear import Linear, fused_linear
from models.layers.mlp import ACTS, GroupedTopKRouter, run_experts
from models.layers.model import CausalLM
from models.layers.norm import RMSNorm
from models.layers.state import run_with_state, short_conv
from models.layers.tensor_parallel import column, ffn, first_rank_only, heads, row, shard

KINDS = {"linear_attention": "mamba2", "full_attention": "attn", "mlp": "mlp", "moe": "mlp"}


class GroupedGatedRMSNorm(nn.Module):
    """y = w * norm(x * silu(z)), the RMS taken over each of `groups` channel groups, in fp32; on
    CPU one compiled pass per row (kernels/native.py)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        if dim % groups:
            raise ValueError(f"n_groups: {groups} does not divide the mamba inner size {dim}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        out = native.gated_group_norm(x, z, self.weight, self.groups, self.eps)
        if out is not None:
            return out
        y = (x.float() * F.silu(z.float())).unflatten(-1, (self.groups, -1))  # [T, G, D/G]
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y.flatten(-2)).to(z.dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> [z, xBC, dt]; causal conv over xBC; SSD with per-group B/C and a D skip;
    silu(z)-gated grouped RMSNorm; out_proj.

    dt = max(softplus(dt + dt_bias), time_step_min), the limit transformers' chunked path
    applies; its decode step skips it, we apply it in both so that prefill and decode agree.
    """

    # the CPU prefill kernel applies the gated norm to its fp32 rows while they are in cache
    fuse_norm = True

    def __init__(self, cfg, state_idx: int):
        super().__init__()
        self.h, self.p, self.g, self.s = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        if self.h % self.g:
            raise ValueError(f"n_groups: {self.g} does not divide mamba_num_heads {self.h}")
        self.state_idx, self.chunk, self.dt_min = state_idx, cfg.chunk_size, cfg.time_step_min
        self.act = cfg.mamba_hidden_act
        inner = self.h * self.p
        self.conv_dim = inner + 2 * self.g * self.s
        self.in_proj = Linear(cfg.hidden_size, inner + self.conv_dim + self.h, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, groups=self.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        self.norm = GroupedGatedRMSNorm(inner, self.g, cfg.layer_norm_epsilon)
        self.out_proj = Linear(inner, cfg.hidden_size, bias=cfg.use_bias)

    def shard(self, tp) -> None:
        """Heads [r H / N, (r + 1) H / N) and the B/C groups they read (n_groups split too)."""
        h, p, g, s = self.h, self.p, self.g, self.s
        hp, hh = heads(h * p, h, "mamba_num_heads"), heads(h, h, "mamba_num_heads")
        gs = heads(g * s, g, "n_groups")
        column(self.in_proj, tp, [*hp, *hp, *gs, *gs, *hh])  # [z | x | B | C | dt]
        shard(self.conv1d.weight, tp, [*hp, *gs, *gs])
        shard(self.conv1d.bias, tp, [*hp, *gs, *gs])
        for param in (self.dt_bias, self.A_log, self.D):
            shard(param, tp, hh)
        shard(self.norm.weight, tp, heads(h * p, g, "n_groups"))
        row(self.out_proj, tp, hp)
        self.h, self.g, self.norm.groups = h // tp.world, g // tp.world, self.norm.groups // tp.world
        self.conv_dim = self.h * p + 2 * self.g * s

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, dev = x.shape[0], x.device
        h, p, g, s = self.h, self.p, self.g, self.s
        buf = batch.memory.state[self.state_idx]
        z, xbc, dt = self.in_proj(x).split_with_sizes([h * p, self.conv_dim, h], -1)
        w, b = self.conv1d.weight[:, 0], self.conv1d.bias  # [conv_dim, W], [conv_dim] | None
        if batch.fused_decode:  # the steps below in one compiled call (the same bits)
            y = native.mamba_decode(xbc, w, b, buf["conv"], self.act == "silu", dt, self.dt_bias, self.dt_min,
                                    self.A_log, self.D, buf["recurrent"], batch.state_slots, (h, p, g, s), z, self.norm)
            if y is not None:
                return self.out_proj(y)
        xbc = short_conv(batch, buf["conv"], xbc, w, b, self.act)  # [T, conv_dim]
        xs, B, C = xbc.split_with_sizes([h * p, g * s, g * s], -1)
        xs = xs.reshape(t, h, p).float()  # [T, H, P]
        B, C = B.reshape(t, g, s), C.reshape(t, g, s)  # [T, G, S]
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)  # [T, H]
        A = -self.A_log.float().exp()  # [H]
        chunk, step = kernels.get("mamba2_prefill", dev), kernels.get("mamba2_decode", dev)
        args = lambda rows: (xs[rows], dt[rows], A, B[rows], C[rows], self.D.float())  # noqa: E731
        normed = []  # the prefill kernel's rows came back through the gated norm (fp32 only)
        fuse = self.fuse_norm and z.dtype == torch.float32
        norm = (self.norm.weight, self.norm.groups, self.norm.eps) if fuse else None

        def prefill_in_place(rows, st, slots, fresh, cu, ck, ck_slots, out):
            gate = None if norm is None else (z[rows], *norm)
            y = chunk_ssd_in_place(*args(rows), st, slots, fresh, cu, ck, ck_slots, self.chunk, out, gate)
            normed.append(gate is not None and y is not None)
            return y

        y = run_with_state(
            batch,
            buf["recurrent"],
            lambda rows, s0, cu, ck: chunk(*args(rows), initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                           checkpoint_at=ck, chunk_size=self.chunk),
            lambda rows, s0: step(*args(rows), initial_state=s0, output_final_state=True,
                                  cu_seqlens=torch.arange(rows.stop - rows.start + 1, device=dev)),
            lambda rows, st, slots: native.ssd_step(*args(rows), st, slots),  # CPU: states in place
            lambda cp, rows, s0, ck: context_parallel.ssd_prefill(cp, chunk, *args(rows), s0, ck, self.chunk),
            prefill_in_place if chunk is chunk_ssd else None,
        ).reshape(t, -1)  # [T, H * P] fp32
        if not any(normed):
            return self.out_proj(self.norm(y, z))
        pre = batch.num_prefill_tokens  # the decode rows after them are not normed yet
        if pre < t:
            y[pre:] = self.norm(y[pre:], z[pre:])
        return self.out_proj(y)


class Attention(nn.Module):
    """GQA without positional encoding over paged KV {"k", "v": [num_pages, page_size, Hkv, D]}."""

    def __init__(self, cfg, kv_idx: int):
        super().__init__()
        hid, h, hkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or hid // h
        if h % hkv:
            raise ValueError(f"num_key_value_heads: {hkv} does not divide num_attention_heads {h}")
        self.h, self.hkv, self.d, self.kv_idx = h, hkv, d, kv_idx
        self.q_proj = Linear(hid, h * d, bias=False)
        self.k_proj = Linear(hid, hkv * d, bias=False)
        self.v_proj = Linear(hid, hkv * d, bias=False)
        self.o_proj = Linear(h * d, hid, bias=False)

    def shard(self, tp) -> None:
        q = heads(self.h * self.d, self.h, "num_attention_heads")
        kv = heads(self.hkv * self.d, self.hkv, "num_key_value_heads")
        column(self.q_proj, tp, q)
        column(self.k_proj, tp, kv)
        column(self.v_proj, tp, kv)
        row(self.o_proj, tp, q)
        self.h, self.hkv = self.h // tp.world, self.hkv // tp.world

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = fused_linear(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(t, self.h, self.d)  # [T, H, D]
        k, v = k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)  # [T, Hkv, D]
        cache = batch.memory.kv[self.kv_idx]
        if batch.fused_decode:  # the steps below in one compiled call (the same bits)
            o = native.attention_decode(q, k, v, cache["k"], cache["v"], batch.kv_slots, batch.page_table,
                                        batch.seq_lens, self.d**-0.5)
            if o is not None:
                return self.o_proj(o)
        context_parallel.store_kv(batch, cache["k"], cache["v"], k, v)
        attn = kernels.get("attention", x.device)
        o = attn(q, cache["k"], cache["v"], batch.page_table, batch.cu_seqlens, batch.seq_lens,
                 self.d**-0.5)  # [T, H, D]
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    """down(act(up(x))): NemotronH's ungated MLP (relu2), also its experts."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def parts(self):
        return None, self.up_proj, self.down_proj, self.act

    def shard(self, tp) -> None:
        ffn(self, tp)


class MoE(nn.Module):
    """Sigmoid grouped top-k routing over ungated experts (optionally in a latent space) plus
    one shared expert."""

    def __init__(self, cfg):
        super().__init__()
        hid, act, latent = cfg.hidden_size, cfg.mlp_hidden_act, cfg.moe_latent_size
        self.gate = GroupedTopKRouter(cfg)
        d = latent or hid
        self.experts = nn.ModuleList(MLP(d, cfg.moe_intermediate_size, act) for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(hid, cfg.moe_shared_expert_intermediate_size, act, cfg.mlp_bias)
        self.fc1_latent_proj = Linear(hid, latent, bias=cfg.mlp_bias) if latent else nn.Identity()
        self.fc2_latent_proj = Linear(latent, hid, bias=cfg.mlp_bias) if latent else nn.Identity()

    def shard(self, tp) -> None:
        """Every expert's and the shared expert's intermediate channels; the latent projections
        are replicated (fc2's bias on rank 0: it is added to a partial sum)."""
        for expert in (*self.experts, self.shared_experts):
            ffn(expert, tp)
        if isinstance(self.fc2_latent_proj, nn.Linear):
            first_rank_only(self.fc2_latent_proj.bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)  # [T, top_k]
        routed = run_experts(self.fc1_latent_proj(x), self.experts, idx, w)
        return self.fc2_latent_proj(routed) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg, i: int, mixer_idx: int):
        super().__init__()
        kind = cfg.layers_block_type[i]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer: nn.Module = Mamba2Mixer(cfg, mixer_idx)
        elif kind == "full_attention":
            self.mixer = Attention(cfg, mixer_idx)
        elif kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)
        self.stateful = kind in ("linear_attention", "full_attention")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch):
        h, residual = self.norm.add(x, residual)
        return (self.mixer(h, batch) if self.stateful else self.mixer(h)), residual


class NemotronHForCausalLM(CausalLM):
    prefix, embed_name, norm_name = "backbone", "embeddings", "norm_f"
    keep_fp32 = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log", "mixer.D")
    ignore_prefixes = ("mtp.",)

    def __init__(self, hf):
        super().__init__(hf, NemotronHBlock, hf.layer_norm_epsilon)

    @staticmethod
    def layer_kinds(hf) -> tuple[str, ...]:
        bad = sorted(set(hf.layers_block_type) - set(KINDS))
        if bad:
            raise ValueError(f"layers_block_type: unknown type(s) {bad}; known: {sorted(KINDS)}")
        return tuple(KINDS[t] for t in hf.layers_block_type)

    @classmethod
    def model_config(cls, hf, dtype: torch.dtype) -> ModelConfig:
        d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        h, p, s = hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size
        conv_dim = h * p + 2 * hf.n_groups * s
        ssm_dtype = getattr(torch, str(hf.mamba_ssm_cache_dtype).removeprefix("torch."))  # "float32" or a dtype
        return ModelConfig.uniform(
            hf, cls.layer_kinds(hf),
            kv={"k": (hf.num_key_value_heads, d), "v": (hf.num_key_value_heads, d)},
            state={"recurrent": ((h, p, s), ssm_dtype), "conv": ((conv_dim, hf.conv_kernel - 1), dtype)},
            kernel_chunks={"mamba2": hf.chunk_size},
            dtype=dtype,
        )
