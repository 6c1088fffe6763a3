"""Reference paged attention: per sequence, per head, per query, plain softmax in fp32."""
from __future__ import annotations

import torch

from kernels.attention.kv import check_paged_args


def naive_paged_attention(
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
    dv = check_paged_args(q, k_cache, v_cache, page_table, seq_lens, v_dim)
    t, h, dk = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    values = k_cache if v_cache is None else v_cache
    cu = [0, t] if cu_seqlens is None else cu_seqlens.tolist()
    scale = dk**-0.5 if scale is None else scale
    o = torch.zeros(t, h, dv)
    for n in range(len(cu) - 1):
        e, num_keys = cu[n + 1] - cu[n], int(seq_lens[n])
        if e == 0:
            continue
        slots = [(int(page_table[n, p // page_size]), p % page_size) for p in range(num_keys)]
        k = torch.stack([k_cache[pg, row] for pg, row in slots]).float()  # [L, Hkv, Dk]
        v = torch.stack([values[pg, row, :, :dv] for pg, row in slots]).float()  # [L, Hkv, Dv]
        for head in range(h):
            g = head // (h // hkv)
            for i in range(e):
                pos = num_keys - e + i
                scores = k[: pos + 1, g] @ q[cu[n] + i, head].float() * scale  # [pos+1]
                o[cu[n] + i, head] = torch.softmax(scores, dim=0) @ v[: pos + 1, g]
    return o.to(q.dtype)
