"""fp32 token-by-token reference of the gated delta rule (KDA, and GDN by broadcasting g).

Per value head, with the state S [K, V] and token t:
    S <- diag(exp(g_t)) S                      decay first,
    S <- S + beta_t k_t (v_t - S^T k_t)^T      then the delta-rule write,
    o_t = scale * S^T q_t                      read after the write.
This is FLA's `naive_recurrent_kda` and transformers' `recurrent_kimi_delta_attention`.
Value head h reads q/k head h // (HV // H).
"""
from __future__ import annotations

import torch

from kernels.kda.common import check_checkpoints, check_inputs, seq_bounds


def naive_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, checkpoint_at=None):
    """Reference KDA: q, k [T, H, K]; v [T, HV, V]; g [T, HV, K] log decay; beta [T, HV].

    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None) and, when
    checkpoint_at is given, states [C, HV, K, V] after each checkpoint position.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=False)
    return naive_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            checkpoint_at)


def naive_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     checkpoint_at):
    """naive_kda without argument checks; g may be [T, HV, K] or [T, HV, 1]."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    scale = K ** -0.5 if scale is None else scale
    cu = seq_bounds(cu_seqlens, T)
    N = len(cu) - 1
    q, k = (x.float().repeat_interleave(HV // H, dim=1) for x in (q, k))  # [T, HV, K]
    vf, g, beta = v.float(), g.float(), beta.float()
    o = torch.zeros(T, HV, V, dtype=torch.float32, device=v.device)
    final = torch.zeros(N, HV, K, V, dtype=torch.float32, device=v.device)
    wanted = {}
    if checkpoint_at is not None:
        cp = check_checkpoints(checkpoint_at, cu)
        for i, (n, length) in enumerate(zip(cp.seq.tolist(), cp.length.tolist())):
            wanted.setdefault((n, length), []).append(i)
        states = torch.zeros(len(cp.seq), HV, K, V, dtype=torch.float32, device=v.device)
    for n in range(N):
        S = final[n] if initial_state is None else initial_state[n].clone()  # [HV, K, V]
        for t in range(cu[n], cu[n + 1]):
            S = S * g[t].exp()[..., None]
            err = vf[t] - torch.einsum("hkv,hk->hv", S, k[t])  # [HV, V]
            S = S + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * err)
            o[t] = scale * torch.einsum("hkv,hk->hv", S, q[t])
            for i in wanted.get((n, t + 1 - cu[n]), ()):
                states[i] = S
        final[n] = S
    out = (o.to(v.dtype), final if output_final_state else None)
    return out if checkpoint_at is None else (*out, states)
