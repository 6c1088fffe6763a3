"""Fixtures of the kernel tests."""
import pytest


@pytest.fixture(params=["compiled", "torch"])
def chunk_impl(request, monkeypatch):
    """Every test runs on both chunk implementations: the compiled CPU kernel (where it is built)
    and the torch formulation."""
    from kernels import native

    if request.param == "compiled" and native.extension() is None:
        pytest.skip("CPU kernels not built here")
    if request.param == "torch":
        monkeypatch.setattr(native, "chunk_delta_rule", lambda *a: None)
    return request.param
