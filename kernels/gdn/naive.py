"""fp32 token-by-token reference of Gated DeltaNet: naive KDA with g broadcast over K."""
from __future__ import annotations

from kernels.kda.common import check_inputs
from kernels.kda.naive import naive_delta_rule


def naive_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, checkpoint_at=None):
    """Reference GDN: as kernels.kda.naive_kda with g [T, HV] (one log decay per value head)."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
    return naive_delta_rule(q, k, v, g[..., None], beta, scale, initial_state, output_final_state,
                            cu_seqlens, checkpoint_at)
