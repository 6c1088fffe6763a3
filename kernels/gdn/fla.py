"""Gated DeltaNet on CUDA through FLA 0.6 (`chunk_gated_delta_rule` prefill,
`fused_recurrent_gated_delta_rule` decode). FLA's conventions and the checkpoint scheme are
those of kernels/kda/fla.py; g is [T, HV], one natural-log decay per value head."""
from __future__ import annotations

from kernels.kda.common import check_inputs
from kernels.kda.fla import packed_call, run_with_checkpoints


def fla_chunk_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, checkpoint_at=None):
    """GDN prefill on CUDA; contract and returns as kernels.gdn.chunk_gdn."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return run_with_checkpoints(packed_call(chunk_gated_delta_rule), q, k, v, g, beta, scale,
                                initial_state, output_final_state, cu_seqlens, checkpoint_at)


def fla_recurrent_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, checkpoint_at=None):
    """GDN decode on CUDA; contract and returns as kernels.gdn.recurrent_gdn."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return run_with_checkpoints(packed_call(fused_recurrent_gated_delta_rule), q, k, v, g, beta, scale,
                                initial_state, output_final_state, cu_seqlens, checkpoint_at)
