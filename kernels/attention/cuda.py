"""Paged attention on CUDA: flash-attn 2 `flash_attn_varlen_func` with `block_table`.

flash-attn 2 reads K/V straight from the pages (its causal mask is aligned bottom-right,
i.e. the queries sit at the end of the keys, as our contract says) but accepts only:
fp16/bf16 tensors of one dtype, page_size a multiple of 256, one head dim shared by q, k
and v (so no MLA latent layout with Dv < Dk), at most 256 and a multiple of 8. Any other
call, or a machine without flash-attn, runs `kernels.attention.torch.paged_attention` on
the same device; `flash_unsupported` names the reason and a warning says it (Python's
default filter shows each distinct reason once).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from kernels.attention.kv import check_paged_args, query_lens
from kernels.attention.torch import paged_attention

FLASH_PAGE_MULTIPLE = 256
FLASH_MAX_HEAD_DIM = 256


@functools.cache
def _flash_varlen():
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn does not import."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def flash_unsupported(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    v_dim: int | None = None,
) -> str | None:
    """Why flash-attn 2 cannot run this call (shapes first, then device, then install),
    or None when it can."""
    dk = q.shape[-1]
    dv = v_dim if v_cache is None else v_cache.shape[-1]
    page_size = k_cache.shape[1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (flash-attn takes float16/bfloat16)"
    if any(c is not None and c.dtype != q.dtype for c in (k_cache, v_cache)):
        return "q and the caches differ in dtype"
    if page_size % FLASH_PAGE_MULTIPLE != 0:
        return f"page_size {page_size} is not a multiple of {FLASH_PAGE_MULTIPLE}"
    if dk != dv:
        return f"Dk={dk} != Dv={dv} (flash-attn 2 needs one head dim; MLA latent layout)"
    if dk > FLASH_MAX_HEAD_DIM or dk % 8 != 0:
        return f"head dim {dk} (flash-attn 2 needs a multiple of 8, at most {FLASH_MAX_HEAD_DIM})"
    if any(x.stride(-1) != 1 for x in (q, k_cache, v_cache) if x is not None):
        return "a tensor with a non-contiguous last dim"
    if not q.is_cuda:
        return "tensors are not on CUDA"
    if _flash_varlen() is None:
        return "flash-attn is not installed"
    return None


def cuda_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.attention.torch.paged_attention`; o [T, H, Dv]."""
    check_paged_args(q, k_cache, v_cache, page_table, seq_lens, v_dim)
    reason = flash_unsupported(q, k_cache, v_cache, v_dim)
    if reason is not None:
        warnings.warn(f"cuda_paged_attention runs the torch path: {reason}", stacklevel=2)
        return paged_attention(q, k_cache, v_cache, page_table, cu_seqlens, seq_lens, scale, v_dim)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, q.shape[0]], device=q.device)
    cu_k = F.pad(seq_lens.cumsum(0), (1, 0))  # [N+1]
    return _flash_varlen()(
        q,
        k_cache,
        k_cache if v_cache is None else v_cache,
        cu_seqlens.to(torch.int32),
        cu_k.to(torch.int32),
        int(query_lens(cu_seqlens, seq_lens).max()),
        int(seq_lens.max()),
        softmax_scale=scale,
        causal=True,
        block_table=page_table.to(torch.int32),
    )
