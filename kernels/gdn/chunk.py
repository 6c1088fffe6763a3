"""Chunkwise Gated DeltaNet in torch (CPU prefill): the KDA chunk path with g [T, HV, 1];
only the intra-chunk decay matrix takes its scalar-gate form (kernels/kda/intra.py)."""
from __future__ import annotations

from kernels.kda.chunk import chunk_delta_rule
from kernels.kda.common import check_inputs


def chunk_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, checkpoint_at=None):
    """GDN prefill: as kernels.kda.chunk_kda with g [T, HV] (one log decay per value head).

    Returns (o [T, HV, V], final_state [N, HV, K, V] or None[, states [C, HV, K, V]])."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
    return chunk_delta_rule(q, k, v, g[..., None], beta, scale, initial_state, output_final_state,
                            cu_seqlens, checkpoint_at)
