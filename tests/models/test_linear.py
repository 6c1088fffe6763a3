"""fused_linear: projections of one input as one matmul, with one copy of the weights."""
import pytest
import torch
from torch import nn

from models.layers.linear import FUSED, Linear, fused_linear, joined
from models.layers.mlp import STACKS, GatedMLP, run_experts


def linears(outs, dtype, bias=()):
    torch.manual_seed(0)
    return [Linear(64, n, bias=i in bias).to(dtype) for i, n in enumerate(outs)]


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_bf16_outputs_are_those_of_separate_calls_bit_for_bit(rows):
    """Router, shared-expert gate and the shared expert's gate and up (N = 8, 1, 96, 96): each
    fused output equals its own Linear's, every bit (the same dot products)."""
    lins = linears([8, 1, 96, 96], torch.bfloat16)
    x = torch.randn(rows, 64).bfloat16()
    with torch.no_grad():
        want = [lin(x) for lin in lins]
        got = fused_linear(x, *lins)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_fp32_outputs_match_and_weights_are_views_of_one_stack():
    lins = linears([32, 8, 48], torch.float32, bias=(0, 2))  # a bias on some: zeros for the other
    x = torch.randn(7, 64)
    with torch.no_grad():
        want = [lin(x) for lin in lins]
        got = fused_linear(x, *lins)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    f = FUSED[lins[0]]
    assert lins[1].weight.data_ptr() == f.weight[32].data_ptr() and lins[2].bias.data_ptr() == f.bias[40].data_ptr()
    assert lins[1].bias is None and bool((f.bias[32:40] == 0).all())


def test_a_module_moved_after_first_use_gets_a_new_stack():
    """.to() replaces the weights; the stack follows (no stale copy is used)."""
    lins = linears([16, 16], torch.float32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        fused_linear(x, *lins)
        for lin in lins:
            lin.to(torch.float64)
        got = fused_linear(x.double(), *lins)
        assert torch.equal(got[1], lins[1](x.double())) and got[1].dtype == torch.float64


def test_mismatched_inputs_are_refused():
    a, b = nn.Linear(8, 4), nn.Linear(6, 4)
    with pytest.raises(ValueError, match="in_features"):
        fused_linear(torch.randn(2, 8), a, b)


def test_experts_stacked_weights_are_not_copied_again():
    """An expert run by itself (per-expert path) after the padded path stacked the experts
    fuses gate and up over the rows they already hold in the stack: still one copy."""
    torch.manual_seed(0)
    experts = nn.ModuleList(GatedMLP(16, 24) for _ in range(4))
    x = torch.randn(6, 16)
    idx = torch.stack([torch.arange(6) % 4, (torch.arange(6) + 1) % 4], 1)
    with torch.no_grad():
        run_experts(x, experts, idx, torch.rand(6, 2))  # padded: experts stacked
        stack = STACKS[experts].gate_up
        y = experts[2](x)
        assert FUSED[experts[2].gate_proj].weight.data_ptr() == stack[2].data_ptr()
        assert experts[2].up_proj.weight.data_ptr() == stack[2, 24:].data_ptr()
        torch.testing.assert_close(y, experts[2].down_proj(torch.nn.functional.silu(x @ stack[2, :24].T)
                                                            * (x @ stack[2, 24:].T)))


def test_joined_is_a_view_of_consecutive_columns_else_a_copy():
    """Consecutive outputs of fused_linear join as a view of their columns (no copy); others, or
    the same ones out of order, are concatenated; both equal torch.cat."""
    lins = linears([8, 16, 4], torch.float32)
    a, b, c = fused_linear(torch.randn(5, 64), *lins)
    ab = joined(a, b)
    assert ab.data_ptr() == a.data_ptr() and ab.stride() == a.stride() and torch.equal(ab, torch.cat([a, b], -1))
    for parts in ((b, a), (a, c), (a.clone(), b)):
        got = joined(*parts)
        assert got.is_contiguous() and torch.equal(got, torch.cat(parts, -1))
