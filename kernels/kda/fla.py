"""KDA on CUDA through FLA 0.6 (`chunk_kda` prefill, `fused_recurrent_kda` decode).

FLA conventions, checked in its source: inputs are [B, T, ...] with B = 1 for varlen
(cu_seqlens), q/k are used as given (use_qk_l2norm_in_kernel=False), g is a natural-log
decay (use_gate_in_kernel=False), beta is post-sigmoid, scale defaults to K ** -0.5, HV > H
is GVA (value head h reads q/k head h // (HV // H)), initial_state must be fp32 and the
final state is fp32. o comes back in q's dtype; we return it in v's.

checkpoint_at: FLA's `return_intermediate_states` stores chunk states in the input dtype
(bf16 in serving), which would break "resume == from scratch". Instead each sequence is
cut at its checkpoint positions and the pieces run round by round as varlen calls, round r
taking piece r of every sequence and starting from the fp32 final states of round r - 1.
The cuts sit on chunk boundaries, so this is the same arithmetic as one call; it costs one
launch per round (1 + the most checkpoints any sequence has).
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.kda.common import check_checkpoints, check_inputs, seq_bounds

# fn(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens) -> (o, final_state)
DeltaRuleFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, checkpoint_at=None):
    """KDA prefill on CUDA; contract and returns as kernels.kda.chunk_kda."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=False)
    from fla.ops.kda import chunk_kda
    return run_with_checkpoints(packed_call(chunk_kda), q, k, v, g, beta, scale, initial_state,
                                output_final_state, cu_seqlens, checkpoint_at)


def fla_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, checkpoint_at=None):
    """KDA decode on CUDA; contract and returns as kernels.kda.recurrent_kda."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=False)
    from fla.ops.kda import fused_recurrent_kda
    return run_with_checkpoints(packed_call(fused_recurrent_kda), q, k, v, g, beta, scale,
                                initial_state, output_final_state, cu_seqlens, checkpoint_at)


def packed_call(fla_fn) -> DeltaRuleFn:
    """Adapt an FLA op to packed [T, ...] tensors (FLA's varlen layout is [1, T, ...])."""
    def call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        o, final = fla_fn(q=q[None], k=k[None], v=v[None], g=g[None], beta=beta[None], scale=scale,
                          initial_state=initial_state, output_final_state=output_final_state,
                          cu_seqlens=cu_seqlens)
        return o[0].to(v.dtype), final
    return call


def run_with_checkpoints(fn: DeltaRuleFn, q, k, v, g, beta, scale, initial_state, output_final_state,
                         cu_seqlens, checkpoint_at):
    """Call fn once, or, with checkpoint_at, round by round over the pieces between checkpoints."""
    if checkpoint_at is None:
        return fn(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    cu = seq_bounds(cu_seqlens, q.shape[0])
    cp = check_checkpoints(checkpoint_at, cu)
    N, (HV, V), K = len(cu) - 1, v.shape[1:], q.shape[2]
    cuts = [{0, cu[n + 1] - cu[n]} for n in range(N)]
    for n, length in zip(cp.seq.tolist(), cp.length.tolist()):
        cuts[n].add(length)
    pieces = [sorted(c) if len(c) > 1 else [] for c in cuts]  # piece r of n: [p[r], p[r + 1])
    state = q.new_zeros(N, HV, K, V, dtype=torch.float32) if initial_state is None else initial_state.clone()
    o = torch.empty_like(v)
    wanted = set(zip(cp.seq.tolist(), cp.length.tolist()))
    saved = {}
    for r in range(max(len(p) for p in pieces) - 1):
        seqs = [n for n in range(N) if len(pieces[n]) > r + 1]
        spans = [(cu[n] + pieces[n][r], cu[n] + pieces[n][r + 1]) for n in seqs]
        tok = torch.cat([torch.arange(a, b) for a, b in spans]).to(q.device)
        cu_r = torch.tensor([0] + [b - a for a, b in spans]).cumsum(0).to(q.device)
        rows = torch.tensor(seqs, device=q.device)
        o[tok], state[rows] = fn(q[tok], k[tok], v[tok], g[tok], beta[tok], scale, state[rows], True, cu_r)
        for n in seqs:
            if (n, pieces[n][r + 1]) in wanted:
                saved[n, pieces[n][r + 1]] = state[n].clone()
    states = state.new_empty(len(cp.seq), HV, K, V)
    for i, key in enumerate(zip(cp.seq.tolist(), cp.length.tolist())):
        states[i] = saved[key]
    return o, state if output_final_state else None, states
