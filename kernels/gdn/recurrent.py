"""Token-step Gated DeltaNet in torch (CPU decode): the KDA step with g broadcast over K."""
from __future__ import annotations

from kernels.kda.common import check_inputs
from kernels.kda.recurrent import recurrent_delta_rule


def recurrent_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, checkpoint_at=None):
    """GDN decode: as kernels.kda.recurrent_kda with g [T, HV] (one log decay per value head).

    Returns (o [T, HV, V], final_state [N, HV, K, V] or None[, states [C, HV, K, V]])."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
    return recurrent_delta_rule(q, k, v, g[..., None], beta, scale, initial_state, output_final_state,
                                cu_seqlens, checkpoint_at)
