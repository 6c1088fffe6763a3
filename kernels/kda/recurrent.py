"""Token-step gated delta rule in torch (the CPU decode path of KDA and GDN).

Same rule as naive.py, batched over sequences: step t advances every sequence that still
has a t-th token. Decode is one step (one token per sequence).
"""
from __future__ import annotations

import torch

from kernels.kda.common import check_checkpoints, check_inputs, seq_bounds


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, checkpoint_at=None):
    """KDA decode: q, k [T, H, K] (L2-normalised); v [T, HV, V]; g [T, HV, K] log decay;
    beta [T, HV]; initial_state [N, HV, K, V] fp32; cu_seqlens [N+1] int64.

    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None), plus
    states [C, HV, K, V] after each position of checkpoint_at when given. initial_state is
    not modified.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=False)
    return recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                cu_seqlens, checkpoint_at)


def recurrent_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         checkpoint_at):
    """recurrent_kda without argument checks; g may be [T, HV, K] or [T, HV, 1]."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    scale = K ** -0.5 if scale is None else scale
    cu = seq_bounds(cu_seqlens, T)
    N = len(cu) - 1
    if N == T and checkpoint_at is None:  # one token per sequence (decode): a single step
        o, final = delta_step(q, k, v, g, beta, scale, initial_state)
        return o.to(v.dtype), final if output_final_state else None
    starts = torch.tensor(cu[:-1])
    lengths = torch.tensor(cu[1:]) - starts
    order = torch.sort(lengths, descending=True, stable=True).indices  # running sequences first
    S = q.new_zeros(N, HV, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    S = S[order.to(q.device)]  # [N, HV, K, V] in length order
    heads = torch.arange(HV, device=q.device) // (HV // H)
    o = torch.empty(T, HV, V, dtype=torch.float32, device=q.device)
    if checkpoint_at is not None:
        cp = check_checkpoints(checkpoint_at, cu)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(N)
        states = q.new_empty(len(cp.seq), HV, K, V, dtype=torch.float32)
    for t in range(int(lengths.max()) if N else 0):
        a = int((lengths > t).sum())
        tok = (starts[order[:a]] + t).to(q.device)  # [a]
        qt, kt = q[tok][:, heads].float(), k[tok][:, heads].float()  # [a, HV, K]
        s = S[:a] * g[tok].float().exp()[..., None]  # [a, HV, K, V]
        err = v[tok].float() - torch.einsum("nhkv,nhk->nhv", s, kt)  # [a, HV, V]
        s = s + kt[..., None] * (beta[tok].float()[..., None] * err)[:, :, None]
        o[tok] = scale * torch.einsum("nhkv,nhk->nhv", s, qt)
        S[:a] = s
        if checkpoint_at is not None:
            hit = (cp.length == t + 1).nonzero()[:, 0]
            states[hit.to(q.device)] = S[rank[cp.seq[hit]].to(q.device)]
    final = torch.empty_like(S)
    final[order.to(q.device)] = S
    out = (o.to(v.dtype), final if output_final_state else None)
    return out if checkpoint_at is None else (*out, states)


def delta_step(q, k, v, g, beta, scale, state):
    """One token of each of N sequences: q, k [N, H, K]; v [N, HV, V]; g [N, HV, K or 1];
    beta [N, HV]; state [N, HV, K, V] or None (zeros). Returns (o [N, HV, V], new state), fp32."""
    r = v.shape[1] // q.shape[1]  # value heads per key head
    q, k = (x.float().repeat_interleave(r, 1) if r > 1 else x.float() for x in (q, k))  # [N, HV, K]
    if state is None:
        state = v.new_zeros(*k.shape, v.shape[2], dtype=torch.float32)
    s = state.float() * g.float().exp()[..., None]  # [N, HV, K, V] (a new tensor)
    err = v.float() - torch.einsum("nhkv,nhk->nhv", s, k)  # [N, HV, V]
    s = s.addcmul_(k[..., None], (beta.float()[..., None] * err)[:, :, None])
    return scale * torch.einsum("nhkv,nhk->nhv", s, q), s
