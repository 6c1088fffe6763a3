"""Causal attention over a paged KV cache (extend and decode in one call; GQA; MLA latent).

`slot_mapping` places a batch's new tokens in their pages once per batch, `write_kv`
writes each layer's K/V there, then `paged_attention` (CPU; CUDA through
`kernels.dispatch.get("attention", "cuda")`) attends over the pages.
"""
from kernels.attention.kv import PAD_PAGE, slot_mapping, write_kv
from kernels.attention.torch import paged_attention

__all__ = ["PAD_PAGE", "paged_attention", "slot_mapping", "write_kv"]
