"""Causal attention over a paged KV cache in torch (the CPU path; runs on any device).

On CPU a batch with any multi-query segment runs the compiled prefill kernel of
kernels/native.py (query blocks over the pages in place, online softmax, fp32). Otherwise,
or where it is not built, sequences are grouped by query count; each group reads its keys from the pages once and
runs padded SDPA calls in fp32: with `is_causal` where a group has no cached prefix (SDPA
aligns its mask to the top-left, right only when queries and keys coincide), else with an
explicit causal mask, long query blocks cut into pieces of Q_BLOCK queries so the mask and
scores stay bounded.

Decode (one query per sequence) runs the compiled kernel of kernels/native.py,
which reads the pages in place with fp32 accumulation; where it is not built, one batched
matmul pair per KV head over the gathered pages in the cache dtype (BLAS accumulates in
fp32) with an fp32 softmax. o is in q's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.kv import check_paged_args, query_lens, read_kv
from kernels.native import paged_decode, paged_prefill

Q_BLOCK = 1024


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over their sequences' cached keys.

    q [T, H, Dk]; k_cache [num_pages, page_size, Hkv, Dk]; v_cache [num_pages, page_size,
    Hkv, Dv], or None with v_dim: values are k_cache[..., :v_dim] (MLA latent, Hkv = 1);
    page_table [N, P] int64; cu_seqlens [N+1] int64 over the queries (None: one sequence);
    seq_lens [N] keys per sequence, prefix + new. The query block of sequence n sits at the
    END of its seq_lens[n] keys, whose K/V the caller has already written (`write_kv`).
    GQA: query head h reads kv head h // (H // Hkv). scale defaults to Dk ** -0.5.
    Returns o [T, H, Dv].
    """
    dv = check_paged_args(q, k_cache, v_cache, page_table, seq_lens, v_dim)
    t, h, dk = q.shape
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, t], device=q.device)
    q_lens = query_lens(cu_seqlens, seq_lens)  # [N]
    scale = dk**-0.5 if scale is None else scale
    if t > len(q_lens):  # some segment has several queries
        out = paged_prefill(q, k_cache, k_cache if v_cache is None else v_cache, page_table, cu_seqlens, seq_lens,
                            scale, dv)
        if out is not None:
            return out.to(q.dtype)
    if t == len(q_lens) and bool((q_lens == 1).all()):  # decode rows only
        return decode(q, k_cache, v_cache, page_table, seq_lens, scale, dv).to(q.dtype)
    o = q.new_empty(t, h, dv)
    for e in q_lens.unique().tolist():
        if e == 0:
            continue
        rows = (q_lens == e).nonzero().flatten()  # [n]
        lens = seq_lens[rows]  # [n]
        if e == 1:
            o[cu_seqlens[rows]] = decode(q[cu_seqlens[rows]], k_cache, v_cache, page_table[rows], lens, scale,
                                         dv).to(o.dtype)
            continue
        num_keys = int(lens.max())
        k = read_kv(k_cache, page_table[rows], num_keys)  # [n, L, Hkv, Dk]
        v = k[..., :v_dim] if v_cache is None else read_kv(v_cache, page_table[rows], num_keys)  # [n, L, Hkv, Dv]
        k, v = k.float(), v.float()
        tok = cu_seqlens[rows, None] + torch.arange(e, device=q.device)  # [n, E]
        if num_keys == e:  # no cached prefix in this group: SDPA's own causal mask applies
            o[tok] = F.scaled_dot_product_attention(
                q[tok].float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                scale=scale, enable_gqa=h != k.shape[2]).transpose(1, 2).to(o.dtype)
            continue
        q_pos = lens[:, None] - e + torch.arange(e, device=q.device)  # [n, E]
        for s in range(0, e, Q_BLOCK):
            blk = tok[:, s : s + Q_BLOCK]  # [n, Eb]
            o[blk] = _attend(q[blk], q_pos[:, s : s + Q_BLOCK], k, v, scale).to(o.dtype)
    return o


def decode(q, k_cache, v_cache, page_table, lens, scale, dv):
    """One query per sequence: q [n, H, Dk], page_table [n, P], lens [n] -> o [n, H, Dv] fp32.
    The compiled kernel reads the pages in place where it is built (kernels/native.py);
    otherwise the pages are gathered and `_decode` runs."""
    v_rows = k_cache if v_cache is None else v_cache  # MLA latent: values are the first Dv channels of k
    if q.dtype == k_cache.dtype == v_rows.dtype:
        out = paged_decode(q, k_cache, v_rows, page_table, lens, scale, dv)
        if out is not None:
            return out
    num_keys = int(lens.max())
    k = read_kv(k_cache, page_table, num_keys)  # [n, L, Hkv, Dk]
    v = k[..., :dv] if v_cache is None else read_kv(v_cache, page_table, num_keys)  # [n, L, Hkv, Dv]
    return _decode(q, k, v, lens, scale)


def _decode(q, k, v, lens, scale):
    """q [n, H, Dk] (the last query of each sequence); k [n, L, Hkv, Dk], v [n, L, Hkv, Dv]
    in the cache dtype; lens [n] keys per sequence -> o [n, H, Dv] fp32."""
    n, h, _ = q.shape
    hkv = k.shape[2]
    q = q.to(k.dtype).view(n, hkv, h // hkv, -1)  # [n, Hkv, r, Dk]: query heads per KV head
    scores = torch.stack([torch.bmm(k[:, :, g], q[:, g].transpose(1, 2)) for g in range(hkv)], 2)  # [n, L, Hkv, r]
    past = torch.arange(k.shape[1], device=q.device)[None] >= lens[:, None]  # [n, L]
    p = (scores.float() * scale).masked_fill_(past[:, :, None, None], float("-inf")).softmax(1).to(v.dtype)
    o = torch.stack([torch.bmm(p[:, :, g].transpose(1, 2), v[:, :, g]) for g in range(hkv)], 1)  # [n, Hkv, r, Dv]
    return o.reshape(n, h, -1).float()


def _attend(q, q_pos, k, v, scale):
    """q [n, E, H, Dk] at key positions q_pos [n, E]; k [n, L, Hkv, Dk], v [n, L, Hkv, Dv]
    fp32 -> o [n, E, H, Dv] fp32; query i sees keys 0 .. q_pos[i]."""
    num_keys = int(q_pos.max()) + 1
    k, v = k[:, :num_keys], v[:, :num_keys]  # keys past the last query are masked anyway
    k_pos = torch.arange(num_keys, device=q.device)  # [L]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [n, E, L]
    o = F.scaled_dot_product_attention(
        q.float().transpose(1, 2),  # [n, H, E, Dk]
        k.transpose(1, 2),  # [n, Hkv, L, Dk]
        v.transpose(1, 2),  # [n, Hkv, L, Dv]
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )  # [n, H, E, Dv]
    return o.transpose(1, 2)
