"""Gated DeltaNet against independent references.

The delta-rule invariants (split, resume, varlen, checkpoints, decode after prefill, strong
decays, dtypes, the CUDA path) run for GDN too: they are parametrized in test_kda.py.
"""
from __future__ import annotations

import pytest
import torch

from kernels.gdn import chunk_gdn, recurrent_gdn
from kernels.kda import chunk_kda
from tests.kernels.fla_interpret import make_inputs
from tests.utils import import_torch_reference, rel_err

pytestmark = pytest.mark.usefixtures("prefill_impl")  # tests/kernels/conftest.py: compiled and torch

SIZES = dict(H=2, HV=4, K=32, V=16)


def test_matches_fla_naive_gated_delta_rule():
    """chunk_gdn == FLA's pure-torch naive_recurrent_gated_delta_rule (no GVA there; rel < 1e-5)."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    q, k, v, g, beta, h0, _ = make_inputs([150], True, **{**SIZES, "HV": 2})
    o, final = chunk_gdn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, final_ref = naive_recurrent_gated_delta_rule(q[None], k[None], v[None], beta[None], g[None],
                                                        initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref[0]) < 1e-5
    assert rel_err(final, final_ref) < 1e-5


def test_matches_transformers_qwen3_next():
    """chunk_gdn and recurrent_gdn == transformers' torch gated delta rule of qwen3_next (GVA; rel < 1e-5)."""
    qwen = import_torch_reference("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, h0, _ = make_inputs([150], True, **SIZES)
    for ours in (chunk_gdn, recurrent_gdn):
        o, final = ours(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        for ref in (qwen.torch_chunk_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule):
            o_ref, final_ref = ref(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                                   output_final_state=True)
            assert rel_err(o, o_ref[0]) < 1e-5
            assert rel_err(final, final_ref) < 1e-5


def test_scalar_gate_path_equals_kda_with_the_gate_broadcast():
    """The scalar-gate intra-chunk specialisation == the per-channel KDA path with g repeated over K."""
    q, k, v, g, beta, h0, cu = make_inputs([100, 150], True, **SIZES, g_min=-6.0)
    args = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu,
                checkpoint_at=torch.tensor([64, 164]))
    gdn = chunk_gdn(q, k, v, g, beta, **args)
    kda = chunk_kda(q, k, v, g[..., None].expand(-1, -1, SIZES["K"]), beta, **args)
    for a, b in zip(gdn, kda):
        assert rel_err(a, b) < 1e-5
