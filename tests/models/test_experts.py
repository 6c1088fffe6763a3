"""run_experts: the padded batched path and the per-expert path both equal a per-token loop."""
import pytest
import torch
from torch import nn

from models.layers import mlp
from models.layers.mlp import PAD_FREE_ROWS, STACKS, GatedMLP, run_experts
from models.nemotron_h import MLP


def per_token(x, experts, idx, w):
    return torch.stack([sum(w[t, j] * experts[int(idx[t, j])](x[t : t + 1])[0] for j in range(idx.shape[1]))
                        for t in range(x.shape[0])])


def experts_of(kind):
    torch.manual_seed(0)
    if kind == "gated":
        return nn.ModuleList(GatedMLP(16, 24) for _ in range(6))
    return nn.ModuleList(MLP(16, 24, "relu2", bias=True) for _ in range(6))  # ungated, with biases


@pytest.mark.parametrize("kind", ["gated", "ungated+bias"])
@pytest.mark.parametrize("routing", ["balanced", "skewed-few", "skewed"])
def test_run_experts_matches_per_token(monkeypatch, kind, routing):
    """The torch path (the compiled call, where it runs, is tests/kernels/test_gemm.py's): balanced
    routing, or skewed routing of few rows (every token on experts 0 and 1, at most PAD_FREE_ROWS
    per expert), takes the padded batched matmuls; skewed routing of more rows the per-expert
    blocks; both equal the per-token sum, and stacking keeps one copy of the weights (the
    experts' parameters become views of the stack)."""
    monkeypatch.setattr(mlp.native, "moe_runs", lambda x: False)
    experts = experts_of(kind)
    t, k = (PAD_FREE_ROWS + 8 if routing == "skewed" else 12), 2
    x = torch.randn(t, 16)
    if routing == "balanced":
        idx = torch.stack([torch.arange(t) % 6, (torch.arange(t) + 1) % 6], 1)
    else:
        idx = torch.stack([torch.zeros(t, dtype=torch.long), torch.ones(t, dtype=torch.long)], 1)
    w = torch.rand(t, k)
    with torch.no_grad():
        want = per_token(x, experts, idx, w)
        got = run_experts(x, experts, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (experts in STACKS) == (routing != "skewed")
    if routing != "skewed":
        stack = STACKS[experts].up
        assert experts[2].up_proj.weight.data_ptr() == stack[2].data_ptr()
        if kind == "gated":  # gate and up: the two halves of one stack
            gate_up = STACKS[experts].gate_up
            assert experts[2].gate_proj.weight.data_ptr() == gate_up[2].data_ptr()
            assert experts[2].up_proj.weight.data_ptr() == gate_up[2, 24:].data_ptr()
