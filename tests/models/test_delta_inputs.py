"""delta_inputs: the compiled pass gives the torch formulation's q, k, v, g and beta."""
import pytest
import torch

from kernels import native
from models.layers import state
from models.layers.state import delta_inputs


def torch_path(monkeypatch, *args):
    monkeypatch.setattr(state.native, "delta_prepare", lambda *a: None)
    try:
        return delta_inputs(*args)
    finally:
        monkeypatch.undo()


@pytest.mark.skipif(native.extension() is None, reason="CPU kernels not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gdn", "kda"])
def test_compiled_pass_equals_torch(monkeypatch, dtype, layout):
    """GDN: a and b interleaved per key head in one projection (strided views), one decay per
    value head; KDA: one decay per channel. Gate inputs on both sides of softplus's threshold
    (20) and strongly negative; q, k normalised to unit length."""
    gen = torch.Generator().manual_seed(0)
    t, h, k_dim, hv, v_dim = 37, 2, 16, 4, 8
    qkv = torch.randn(t, 2 * h * k_dim + hv * v_dim, generator=gen).to(dtype)
    if layout == "gdn":
        r = hv // h
        ba = (torch.randn(t, h * 2 * r + 3, generator=gen) * 15).to(dtype)[:, 3:]  # rows of a wider output
        b, a = ba.view(t, h, 2 * r).split([r, r], -1)
        dt_bias, A_log = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    else:
        a = (torch.randn(t, hv * k_dim, generator=gen) * 15).to(dtype)[:, None]
        b = torch.randn(t, hv, generator=gen).to(dtype)[:, None]
        dt_bias, A_log = torch.randn(hv * k_dim, generator=gen), torch.randn(1, 1, hv, 1, generator=gen)
    args = (qkv, (h, k_dim, hv, v_dim), a, A_log, dt_bias, b)
    got = delta_inputs(*args)
    want = torch_path(monkeypatch, *args)
    for name, x, y in zip(("q", "k", "v", "g", "beta"), got, want):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.allclose(got[0].norm(dim=-1), torch.ones(t, h), atol=1e-4)
