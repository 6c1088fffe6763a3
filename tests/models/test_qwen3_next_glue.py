"""Qwen3-Next's compiled glue: q / k norm with RoPE, and the softmax routing, equal the torch ops."""
import pytest
import torch

from kernels import native


@pytest.mark.skipif(native.extension() is None, reason="CPU kernels not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norm_rope_and_routing_equal_the_torch_ops(dtype):
    """q / k norm + partial RoPE in one pass (strided heads of a projection, as the attention
    takes them) and the softmax top-k routing give the torch formulation's results."""
    from models.layers.norm import RMSNorm
    from models.qwen3_next import GatedAttention, apply_rope

    gen = torch.Generator().manual_seed(0)
    t, h, d, rot = 9, 3, 16, 4
    x = torch.randn(t, h, 2 * d, generator=gen).to(dtype)[..., :d]  # every other half-row, as q beside its gate
    norm = RMSNorm(d, 1e-6, offset=1.0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen) * 0.1)
        pos = torch.arange(t).float()[:, None] * torch.rand(rot // 2, generator=gen)
        cos, sin = torch.cat([pos, pos], -1).cos(), torch.cat([pos, pos], -1).sin()
        got = GatedAttention.norm_rope(x, norm, cos, sin)
        want = apply_rope(norm(x), cos, sin)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)
    logits = torch.randn(t, 8, generator=gen).to(dtype)
    for renorm in (True, False):
        w, idx = native.topk_softmax(logits, 2, renorm)
        pw, pidx = torch.softmax(logits.float(), -1).topk(2, -1)
        if renorm:
            pw = pw / pw.sum(-1, keepdim=True)
        assert torch.equal(idx, pidx)
        torch.testing.assert_close(w, pw, rtol=1e-6, atol=1e-7)
