"""Fixtures of the kernel tests."""
import pytest


@pytest.fixture(params=["compiled", "torch"])
def prefill_impl(request, monkeypatch):
    """Run a test on both implementations of the CPU prefill kernels: the compiled ones
    (kernels/native.py, where they are built) and the torch formulations."""
    from kernels import native

    if request.param == "compiled" and native.extension() is None:
        pytest.skip("CPU kernels not built here")
    if request.param == "torch":
        monkeypatch.setattr(native, "chunk_delta_rule", lambda *a: None)
        monkeypatch.setattr(native, "causal_conv1d", lambda *a: None)
        monkeypatch.setattr(native, "chunk_ssd", lambda *a: None)
        monkeypatch.setattr("kernels.attention.torch.paged_prefill", lambda *a: None)
    return request.param
