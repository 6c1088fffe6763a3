"""Chunkwise gated delta rule in torch (the CPU prefill path of KDA and GDN).

Per value head and 64-token chunk, with S0 the state at the chunk start and G the in-chunk
cumulative log decay (see naive.py for the per-token rule):
    [U | W] = (I + diag(beta) A_kk)^-1 diag(beta) [V | K * exp(G)]    (WY / UT transform)
    D  = U - W S0                                                     (delta-rule writes)
    S1 = exp(G_last) * S0 + (K * exp(G_last - G))^T D
    O  = scale * ((Q * exp(G)) S0 + A_qk D)
All but the D / S1 recurrence is batched over chunks. Chunks are processed in blocks of
BLOCK (see layout.py) so that the intermediates stay in cache and memory stays O(N + BLOCK)
states; a checkpoint state is copied out as the recurrence passes it (no recomputation).
Where the compiled CPU kernels are built (kernels/native.py), the same rule runs there instead:
one job per (sequence, value head), the chunks in order, nothing gathered or padded.
"""
from __future__ import annotations

import torch

from kernels import native
from kernels.kda.common import check_checkpoints, check_inputs, seq_bounds
from kernels.kda.intra import MIN_LOG_DECAY, intra_chunk, unit_lower_inverse
from kernels.kda.layout import Block, ChunkLayout

BLOCK = 8  # chunks whose intra-chunk work is batched together


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, checkpoint_at=None):
    """KDA prefill: q, k [T, H, K] (L2-normalised); v [T, HV, V]; g [T, HV, K] log decay;
    beta [T, HV]; initial_state [N, HV, K, V] fp32; cu_seqlens [N+1] int64.

    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None), plus
    states [C, HV, K, V] after each position of checkpoint_at when given.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=False)
    return chunk_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            checkpoint_at)


def chunk_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     checkpoint_at):
    """chunk_kda without argument checks; g may be [T, HV, K] or [T, HV, 1] (scalar gate)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    scale = K ** -0.5 if scale is None else scale
    cu = seq_bounds(cu_seqlens, T)
    compiled = _compiled(q, k, v, g, beta, scale, initial_state, cu, checkpoint_at)
    if compiled is not None:
        o, final, states = compiled
        final = final if output_final_state else None
        return (o, final) if checkpoint_at is None else (o, final, states)
    layout = ChunkLayout.build(cu, q.device)
    N = len(cu) - 1
    S = (q.new_zeros(N, HV, K, V, dtype=torch.float32) if initial_state is None
         else initial_state.float()[layout.order])  # [N, HV, K, V] by rank, updated in place
    captures, states = {}, None
    if checkpoint_at is not None:
        cp = check_checkpoints(checkpoint_at, cu)
        captures, states = layout.captures(cp), S.new_empty(len(cp.seq), HV, K, V)
    o = v.new_empty(T, HV, V)
    for block in layout.blocks(BLOCK):
        kq = layout.gather(block, k, q)  # [B, H, C, 2K]
        if HV != H:
            kq = kq.repeat_interleave(HV // H, dim=1)  # value head h reads q/k head h // (HV // H)
        kq = kq.unflatten(-1, (2, K))  # [B, HV, C, (k, q), K]
        vgb = layout.gather(block, v, g, beta[..., None])
        v_b, g_b, beta_b = vgb.split([V, g.shape[-1], 1], dim=-1)  # [B, HV, C, V], [.., K or 1], [.., 1]
        G = g_b.clamp_(min=MIN_LOG_DECAY).cumsum(2)
        y = _block(block, kq, v_b, G, beta_b, S, scale, captures, states)
        layout.scatter(block, y, o)
    final = S[layout.rank] if output_final_state else None
    return (o, final) if checkpoint_at is None else (o, final, states)


def _compiled(q, k, v, g, beta, scale, initial_state, cu, checkpoint_at):
    """(o, final, states) from the compiled kernel, or None where it is not built."""
    K = q.shape[2]
    HV, V = v.shape[1:]
    N = len(cu) - 1
    S = (q.new_zeros(N, HV, K, V, dtype=torch.float32) if initial_state is None
         else initial_state.float().clone(memory_format=torch.contiguous_format))
    rows = torch.zeros(0, 2, dtype=torch.int64)
    if checkpoint_at is not None:
        cp = check_checkpoints(checkpoint_at, cu)
        rows = torch.stack([cp.seq, cp.length], dim=1)
    out = native.chunk_delta_rule(q, k, v, g, beta, S, torch.tensor(cu), rows, scale, MIN_LOG_DECAY)
    if out is None:
        return None
    o, states = out
    return o.to(v.dtype), S, states


def chunk_in_place(q, k, v, g, beta, state, slots, fresh, cu_seqlens, checkpoint_at=None, checkpoint_slots=None,
                   out=None):
    """chunk_delta_rule (scale K^-0.5; g [T, HV, K] or [T, HV, 1]) with each sequence's state a
    row of a pool, through the compiled kernel: state [P, HV, K, V] fp32 (or bf16, rounded after
    every 64-token chunk), sequence n's initial
    state in row slots[n] (zeros where fresh[n]) advanced there in place to its final state, the
    state after each position of checkpoint_at written into row checkpoint_slots[i]. Returns o
    [T, HV, V] in v's dtype (written into `out` where given: contiguous fp32 of o's shape, with v
    fp32), or None where the kernel does not run (nothing is written then)."""
    if not native.state_in_place(state):
        return None
    cu = seq_bounds(cu_seqlens, q.shape[0])
    rows, at = torch.zeros(0, 2, dtype=torch.int64), native.EMPTY
    if checkpoint_at is not None:
        cp = check_checkpoints(checkpoint_at, cu)
        rows, at = torch.stack([cp.seq, cp.length], dim=1), checkpoint_slots
    o = native.out_rows(out, v.shape, torch.float32) if v.dtype == torch.float32 else native.EMPTY
    y = native.chunk_delta_rule(q, k, v, g, beta, state, torch.tensor(cu), rows, q.shape[-1] ** -0.5,
                                MIN_LOG_DECAY, slots, fresh, at, o)
    return None if y is None else y[0].to(v.dtype)


def _block(block: Block, kq, v, G, beta, S, scale, captures, states):
    """Outputs [B, HV, C, V] of the block's B chunks; advances S (and copies checkpoint states)."""
    B, HV, C, _, K = kq.shape
    A_kk, A_qk, kq_in, k_out = intra_chunk(kq.flatten(0, 1), G.flatten(0, 1))
    kq_in = kq_in.view(B, HV, C, 2, K)  # [k, q] decayed from the chunk start
    k_out = k_out.view(B, HV, C, K)  # k decayed to the chunk end
    beta_row = beta.flatten(0, 1)  # [B*HV, C, 1]
    T_inv = (unit_lower_inverse(A_kk * beta_row) * beta_row.transpose(1, 2)).view(B, HV, C, C)
    U, W = T_inv @ v, T_inv @ kq_in[..., 0, :]  # [B, HV, C, V], [B, HV, C, K]
    decay = G[:, :, -1:].transpose(-1, -2).exp()  # [B, HV, K or 1, 1] over the whole chunk
    S0 = S.new_empty(B, HV, *S.shape[2:])  # state at each chunk start
    D = U  # D = U - W S0 overwrites U, chunk by chunk
    for c, step in block.steps:
        cur = slice(step.start - block.start, step.start - block.start + step.active)
        s = S[:step.active]  # ranks still running
        S0[cur] = s
        d = D[cur].flatten(0, 1).baddbmm_(W[cur].flatten(0, 1), s.flatten(0, 1), alpha=-1)
        s.mul_(decay[cur]).flatten(0, 1).baddbmm_(k_out[cur].flatten(0, 1).transpose(1, 2), d)
        for i, r in captures.get(c, ()):
            states[i] = S[r]
    y = torch.bmm(A_qk, D.flatten(0, 1))  # [B*HV, C, V]
    y.baddbmm_(kq_in[..., 1, :].flatten(0, 1), S0.flatten(0, 1), beta=scale, alpha=scale)
    return y.view(B, HV, C, -1)
