"""Running a recurrent op over a ForwardBatch with states kept in slots."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

import kernels
from kernels import native
from kernels.conv1d.torch import causal_conv1d, conv_in_place
from kernels.gdn import chunk_gdn
from kernels.kda import chunk_kda
from kernels.kda.chunk import chunk_in_place
from models.batch import ForwardBatch
from models.layers import context_parallel
from models.layers.context_parallel import ContextParallel
from models.layers.norm import l2norm

# prefill(rows, initial [Np, ...], cu_seqlens [Np+1], checkpoint_at [C] | None)
#   -> (out, final [Np, ...]) or (out, final, states [C, ...])
Prefill = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple]
# decode(rows, initial [Nd, ...]) -> (out, final [Nd, ...])
Decode = Callable[[slice, torch.Tensor], tuple]


# decode_in_place(rows, state, slots [Nd]) -> out, with the states advanced in their slots; or
#   None where it cannot run (then `decode` runs on gathered states)
InPlace = Callable[[slice, torch.Tensor, torch.Tensor], torch.Tensor | None]


# cp_prefill(cp, rows, initial [1, ...], checkpoint_at [C] | None) -> as Prefill, for one segment
#   split across ranks (models/layers/context_parallel.py); `final` is the segment's
CPPrefill = Callable[[ContextParallel, slice, torch.Tensor, torch.Tensor | None], tuple]

# prefill_in_place(rows, state, slots [Np], fresh [Np] bool, cu_seqlens [Np+1], checkpoint_at [C] |
#   None, checkpoint_slots [C] | None, out | None) -> outputs, the states read from and written into
#   their slots (zeros first where fresh), or None where its kernel does not run (nothing written);
#   the outputs written into `out` (the round's output rows, contiguous) where given and the kernel
#   takes it (else returned, and copied there by the caller)
PrefillInPlace = Callable[[slice, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                           torch.Tensor | None, torch.Tensor | None], torch.Tensor | None]


def run_with_state(batch: ForwardBatch, state: torch.Tensor, prefill: Prefill, decode: Decode,
                   decode_in_place: InPlace | None = None, cp_prefill: CPPrefill | None = None,
                   prefill_in_place: PrefillInPlace | None = None) -> torch.Tensor:
    """Run `prefill` on the prefill segments and `decode` on the decode rows.

    Each segment starts from the state in its slot (zeros when prefix_len == 0; decode rows
    always have a prefix). Afterwards every segment's final state is in its slot (in place,
    in the slot's dtype) and every requested checkpoint state is in its checkpoint slot.
    Under context parallelism (`batch.cp`: this rank's slice of one segment) `cp_prefill`
    runs instead, and every rank ends with the segment's final state and all its checkpoints.
    `prefill_in_place` and `decode_in_place`, where given and their kernels run (not None),
    read and write the slots themselves: no gather of the states before, no scatter after.
    Returns the outputs in packing order. In a mixed round the decode rows run first (their
    slots are not the prefills', so the order changes nothing) and their outputs go into the
    round's output, whose first rows the prefill kernel then writes in place: no concatenation
    after (both give the layer's dtype and row shape).
    """
    slots = batch.state_slots
    n_pre, t_pre = batch.num_prefills, batch.num_prefill_tokens
    full = None  # the round's output, decode rows filled in
    if batch.num_decodes:  # decode
        rows = slice(t_pre, batch.num_tokens)
        dec = decode_in_place(rows, state, slots[n_pre:]) if decode_in_place else None
        if dec is None:
            dec, final = decode(rows, state[slots[n_pre:]])
            state[slots[n_pre:]] = final.to(state.dtype)
        if not n_pre:
            return dec
        full = dec.new_empty((batch.num_tokens, *dec.shape[1:]))
        full[t_pre:] = dec
    ck = batch.checkpoint_at if batch.checkpoint_at.numel() else None
    out = None
    if batch.cp is None and prefill_in_place is not None:
        out = prefill_in_place(slice(0, t_pre), state, slots[:n_pre], batch.prefix_lens[:n_pre] == 0,
                               batch.cu_seqlens[: n_pre + 1], ck, batch.checkpoint_slots if ck is not None else None,
                               None if full is None else full[:t_pre])
    if out is None:  # prefill
        init = state[slots[:n_pre]]  # [Np, ...] (a copy)
        if batch.cp is None:
            init[batch.prefix_lens[:n_pre] == 0] = 0
            out, final, *ck_states = prefill(slice(0, t_pre), init, batch.cu_seqlens[: n_pre + 1], ck)
        elif cp_prefill is None:
            raise NotImplementedError("this layer has no context-parallel prefill")
        else:  # one segment, this rank's slice of it
            if batch.cp.prefix_len == 0:
                init.zero_()
            out, final, *ck_states = cp_prefill(batch.cp, slice(0, t_pre), init, ck)
        state[slots[:n_pre]] = final.to(state.dtype)
        if ck is not None:
            state[batch.checkpoint_slots] = ck_states[0].to(state.dtype)
        if batch.cp is not None:
            batch.cp.share_checkpoints(state)
    if full is None:
        return out
    if out.data_ptr() != full.data_ptr():  # not written in place
        full[:t_pre] = out
    return full


def short_conv(batch: ForwardBatch, state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None, activation: str | None = "silu") -> torch.Tensor:
    """Causal depthwise conv of x [T, D] (weight [D, W]) with conv states [slots, D, W-1] in
    slots, through the conv1d kernels (see run_with_state); decode rows through the compiled
    CPU step that updates the slots in place (kernels/native.py), else the step kernel."""
    conv, step = kernels.get("conv1d_prefill", x.device), kernels.get("conv1d_decode", x.device)
    silu = activation == "silu"
    return run_with_state(
        batch,
        state,
        lambda r, s0, cu, ck: conv(x[r], weight, bias, s0, cu_seqlens=cu, activation=activation, checkpoint_at=ck),
        lambda r, s0: step(x[r], weight, bias, s0, activation=activation),
        lambda r, st, slots: native.conv_step(x[r], weight, bias, st, slots, silu),
        lambda cp, r, s0, ck: context_parallel.conv_prefill(cp, conv, x[r], weight, bias, activation, s0, ck),
        (lambda r, st, slots, fresh, cu, ck, ck_slots, out: conv_in_place(x[r], weight, bias, activation, st, slots,
                                                                          fresh, cu, ck, ck_slots, out))
        if conv is causal_conv1d else None,  # the CPU conv path: its kernel in place
    )


def delta_rule(batch: ForwardBatch, state: torch.Tensor, kind: str, q, k, v, g, beta) -> torch.Tensor:
    """The KDA / GDN recurrence (`kind`: "kda" or "gdn") over the batch with its states in
    slots: chunkwise kernel for the prefill segments; for the decode rows the compiled CPU
    step that updates the slots in place (kernels/native.py), else the step kernel. The
    kernels work in fp32; a bf16 state is widened for them and rounded where it is stored."""
    chunk, step = kernels.get(f"{kind}_prefill", q.device), kernels.get(f"{kind}_decode", q.device)

    def args(r):
        return q[r], k[r], v[r], g[r], beta[r]

    def in_place(r, st, slots):
        g_r = g[r] if g.dim() == 3 else g[r][..., None]  # GDN: one decay per value head
        o = native.delta_step(q[r], k[r], v[r], g_r, beta[r], st, slots, q.shape[-1] ** -0.5)
        return None if o is None else o.to(v.dtype)

    def prefill_in_place(r, st, slots, fresh, cu, ck, ck_slots, out):
        g_r = g[r] if g.dim() == 3 else g[r][..., None]
        return chunk_in_place(q[r], k[r], v[r], g_r, beta[r], st, slots, fresh, cu, ck, ck_slots, out)

    return run_with_state(
        batch,
        state,
        lambda r, s0, cu, ck: chunk(*args(r), initial_state=s0.float(), output_final_state=True, cu_seqlens=cu,
                                    checkpoint_at=ck),
        lambda r, s0: step(*args(r), initial_state=s0.float(), output_final_state=True,
                           cu_seqlens=torch.arange(r.stop - r.start + 1, device=q.device)),
        in_place,
        lambda cp, r, s0, ck: context_parallel.delta_rule_prefill(cp, chunk, q[r], k[r], v[r], g[r], beta[r],
                                                                  s0.float(), ck),
        prefill_in_place if chunk in (chunk_kda, chunk_gdn) else None,  # the CPU chunk path: its kernel in place
    )


L2_EPS = 1e-6  # the eps of the q and k l2 norms of KDA / GDN


def delta_decode(batch: ForwardBatch, buf: dict[str, torch.Tensor], qkv: torch.Tensor, conv_w: torch.Tensor,
                 heads: tuple[int, int, int, int], a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 b: torch.Tensor, norm, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A decode-only batch through a KDA / GDN layer's body in one compiled call: what short_conv,
    delta_inputs, delta_rule and the gated output norm `norm` compute on it, one after the other
    (the same bits), the conv and recurrent states (`buf`) advanced in their slots. [T, HV, V] in
    `dtype`, or None where it does not run (prefill rows, context parallelism, no CPU kernel):
    then the caller takes those steps."""
    if not batch.fused_decode:
        return None
    return native.delta_decode(qkv, conv_w, buf["conv"], buf["recurrent"], batch.state_slots, heads, a, A_log,
                               dt_bias, b, L2_EPS, gate, norm, dtype)


def delta_inputs(qkv: torch.Tensor, heads: tuple[int, int, int, int], a: torch.Tensor, A_log: torch.Tensor,
                 dt_bias: torch.Tensor, b: torch.Tensor, eps: float = L2_EPS) -> tuple[torch.Tensor, ...]:
    """The delta-rule kernels' inputs from a KDA / GDN layer's conv output and gate projections.

    qkv [T, 2*H*K + HV*V]: q heads, k heads, v heads (`heads` = (H, K, HV, V)); a [T, G, C]: the
    decays' inputs, HV (GDN) or HV*K (KDA) per token; b [T, Gb, Cb]: HV beta inputs per token (views
    with any strides but the last). Returns fp32 q, k [T, H, K] (l2-normalised), v [T, HV, V],
    g = -exp(A_log) softplus(a + dt_bias) [T, HV, a's count / HV], beta = sigmoid(b) [T, HV]; on
    CPU in one compiled pass (kernels/kda/cpu_prepare.cpp)."""
    h, k_dim, hv, v_dim = heads
    out = native.delta_prepare(qkv, h, k_dim, hv, v_dim, a, A_log, dt_bias, b, eps)
    if out is not None:
        return out
    t = qkv.shape[0]
    q, k, v = qkv.split([h * k_dim, h * k_dim, hv * v_dim], -1)
    q, k = l2norm(q.reshape(t, h, k_dim), eps), l2norm(k.reshape(t, h, k_dim), eps)
    gk = a.shape[1] * a.shape[2] // hv
    u = a.reshape(t, hv, gk).float() + dt_bias.float().reshape(hv, gk)
    g = -A_log.float().reshape(hv, 1).exp() * F.softplus(u, threshold=20.0)
    return q, k, v.reshape(t, hv, v_dim).float(), g, b.reshape(t, hv).float().sigmoid()
