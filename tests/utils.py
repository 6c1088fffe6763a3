"""Helpers shared by the test suite."""
from __future__ import annotations

import importlib
import sys
from types import ModuleType

import torch

# CUDA-only packages that transformers would pick over its torch path if importable.
_CUDA_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


def import_torch_reference(module: str) -> ModuleType:
    """Import a transformers modeling module so that it binds its pure-torch kernels.

    transformers picks FLA / causal-conv1d / mamba-ssm at import time when they import,
    and FLA imports on CPU but cannot run there. We hide those packages while the module
    is imported for the first time; the choice it makes then is kept for the process.
    """
    if module in sys.modules:
        return sys.modules[module]
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in _CUDA_PACKAGES}
    for name in _CUDA_PACKAGES:
        sys.modules[name] = None  # makes `import name` raise ImportError
    try:
        return importlib.import_module(module)
    finally:
        for name in _CUDA_PACKAGES:
            del sys.modules[name]
        sys.modules.update(saved)
