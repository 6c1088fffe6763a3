"""Paged KV layout: where a token lives, writing new tokens, reading a sequence back.

A cache is `[num_pages, page_size, Hkv, D]`. Position p of sequence n lives in page
`page_table[n, p // page_size]`, row `p % page_size`; its slot is `page * page_size + row`.
Entries of `page_table` past a sequence's last page hold PAD_PAGE and are never read.

MLA latent layout: one tensor holds `[kv_lora_rank + rope_dim]` per token (Hkv = 1); with
`v_cache=None, v_dim=kv_lora_rank` the values are `k_cache[..., :v_dim]`.
"""
from __future__ import annotations

import torch

PAD_PAGE = -1  # page-table entries past a sequence's pages (not a page id; never read)


def query_lens(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Queries per sequence [N] from cu_seqlens [N+1], checked to fit in seq_lens [N]."""
    q_lens = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
    if q_lens.shape != seq_lens.shape:
        n = seq_lens.shape[0]
        raise ValueError(f"cu_seqlens must be [N+1={n + 1}], got {tuple(cu_seqlens.shape)}")
    if bool((seq_lens < q_lens).any()) or bool((q_lens < 0).any()):
        raise ValueError("seq_lens must be >= the query count of each sequence (prefix + new)")
    return q_lens


def slot_mapping(
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Cache slots [T] int64 of the new tokens of a batch.

    The query block of sequence n (tokens cu_seqlens[n] .. cu_seqlens[n+1]-1) holds the
    positions seq_lens[n] - q_len .. seq_lens[n] - 1: the same metadata `paged_attention`
    takes, so one batch description serves both. Compute once per batch, reuse per layer.
    """
    q_lens = query_lens(cu_seqlens, seq_lens)  # [N]
    n = q_lens.numel()
    seq_id = torch.repeat_interleave(torch.arange(n, device=q_lens.device), q_lens)  # [T]
    token = torch.arange(seq_id.numel(), device=q_lens.device)  # [T]
    pos = token - cu_seqlens[seq_id] + (seq_lens - q_lens)[seq_id]  # [T]
    pages = page_table[seq_id, pos // page_size]  # [T]
    return pages * page_size + pos % page_size


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None = None,
) -> None:
    """Write k [T, Hkv, Dk] (and v [T, Hkv, Dv]) into their slots [T], in place.

    v_cache and v are both None for the MLA latent layout. The caches must be viewable as
    [num_pages * page_size, Hkv, D] (a contiguous pool or a per-layer slice of one).
    """
    if (v_cache is None) != (v is None):
        raise ValueError("v must be given exactly when v_cache is (both None for MLA latent)")
    for cache, new in ((k_cache, k), (v_cache, v)):
        if cache is None or new is None:  # no v for the MLA latent layout
            continue
        if new.shape[1:] != cache.shape[2:]:
            rows = tuple(cache.shape[2:])
            raise ValueError(f"k/v {tuple(new.shape)} do not fit cache rows {rows}")
        flat = cache.view(-1, *cache.shape[2:])  # [num_pages * page_size, Hkv, D]
        flat.index_copy_(0, slots, new.to(cache.dtype))


def read_kv(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    num_keys: int,
) -> torch.Tensor:
    """Positions 0 .. num_keys-1 of every row of page_table [N, P]: [N, num_keys, Hkv, D].

    Rows of sequences shorter than num_keys hold arbitrary values past their end.
    """
    page_size = cache.shape[1]
    n_pages = -(-num_keys // page_size)
    pages = page_table[:, :n_pages].clamp(min=0)  # [N, P']
    rows = cache.view(cache.shape[0], -1).index_select(0, pages.flatten())  # whole pages: one row copy each
    return rows.view(pages.shape[0], n_pages * page_size, *cache.shape[2:])[:, :num_keys]  # [N, L, Hkv, D]


def check_paged_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    v_dim: int | None,
) -> int:
    """Validate the shapes of a paged attention call; return the value dim Dv."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, Dk], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[-1] != q.shape[-1]:
        want = f"[num_pages, page_size, Hkv, Dk={q.shape[-1]}]"
        raise ValueError(f"k_cache must be {want}, got {tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"k_cache heads Hkv={k_cache.shape[2]} must divide q heads H={q.shape[1]}")
    if page_table.dim() != 2 or page_table.shape[0] != seq_lens.shape[0]:
        n = seq_lens.shape[0]
        raise ValueError(f"page_table must be [N={n}, P], got {tuple(page_table.shape)}")
    if v_cache is None:
        if v_dim is None or not 0 < v_dim <= k_cache.shape[-1]:
            dk = k_cache.shape[-1]
            raise ValueError(f"v_dim must be in 1..{dk} when v_cache is None, got {v_dim}")
        return v_dim
    if v_dim is not None:
        raise ValueError("v_dim is only for the latent layout (v_cache=None)")
    if v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        want = f"[{', '.join(map(str, k_cache.shape[:3]))}, Dv]"
        raise ValueError(f"v_cache must be {want}, got {tuple(v_cache.shape)}")
    return v_cache.shape[-1]
