"""One explicit registry: (op, device) -> implementation.

Implementations are named as "module:function" and imported on first use, so the CUDA
paths (FLA Triton kernels, causal-conv1d, mamba-ssm, flash-attn) are never imported on a
machine without CUDA.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

_REGISTRY: dict[tuple[str, str], str] = {
    # Kimi Delta Attention: chunkwise prefill, one-token-per-sequence decode step
    ("kda_prefill", "cpu"): "kernels.kda.chunk:chunk_kda",
    ("kda_decode", "cpu"): "kernels.kda.recurrent:recurrent_kda",
    ("kda_prefill", "cuda"): "kernels.kda.fla:fla_chunk_kda",
    ("kda_decode", "cuda"): "kernels.kda.fla:fla_recurrent_kda",
    # Gated DeltaNet (scalar gate)
    ("gdn_prefill", "cpu"): "kernels.gdn.chunk:chunk_gdn",
    ("gdn_decode", "cpu"): "kernels.gdn.recurrent:recurrent_gdn",
    ("gdn_prefill", "cuda"): "kernels.gdn.fla:fla_chunk_gdn",
    ("gdn_decode", "cuda"): "kernels.gdn.fla:fla_recurrent_gdn",
    # Mamba2 SSD
    ("mamba2_prefill", "cpu"): "kernels.mamba2.chunk:chunk_ssd",
    ("mamba2_decode", "cpu"): "kernels.mamba2.recurrent:recurrent_ssd",
    ("mamba2_prefill", "cuda"): "kernels.mamba2.cuda:cuda_chunk_ssd",
    ("mamba2_decode", "cuda"): "kernels.mamba2.cuda:cuda_recurrent_ssd",
    # causal depthwise conv1d with a conv state
    ("conv1d_prefill", "cpu"): "kernels.conv1d.torch:causal_conv1d",
    ("conv1d_decode", "cpu"): "kernels.conv1d.torch:causal_conv1d_update",
    ("conv1d_prefill", "cuda"): "kernels.conv1d.cuda:cuda_causal_conv1d",
    ("conv1d_decode", "cuda"): "kernels.conv1d.cuda:cuda_causal_conv1d_update",
    # attention over paged KV (extend and decode; GQA and MLA-latent shapes)
    ("attention", "cpu"): "kernels.attention.torch:paged_attention",
    ("attention", "cuda"): "kernels.attention.cuda:cuda_paged_attention",
}

_LOADED: dict[tuple[str, str], Callable] = {}


def ops() -> list[tuple[str, str]]:
    """All registered (op, device) pairs."""
    return sorted(_REGISTRY)


def get(op: str, device: str | torch.device) -> Callable:
    """The implementation of `op` for `device` ("cpu", "cuda" or a torch.device).

    Raises KeyError naming the known ops and devices when the pair is not registered.
    """
    dev = torch.device(device).type
    key = (op, dev)
    if key not in _REGISTRY:
        known = ", ".join(f"{o}@{d}" for o, d in ops())
        raise KeyError(f"no kernel registered for op={op!r} on device={dev!r}; known: {known}")
    if key not in _LOADED:
        module, name = _REGISTRY[key].split(":")
        _LOADED[key] = getattr(importlib.import_module(module), name)
    return _LOADED[key]
