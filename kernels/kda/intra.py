"""Intra-chunk terms of the gated delta rule, without exp overflow.

For one chunk with in-chunk cumulative log decay G [C, K] (non-increasing along C):
    A_kk[i, j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])   for j < i
    A_qk[i, j] = sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])   for j <= i
    kq_in = [k, q] * exp(G)          (decayed from the chunk start)
    k_out = k * exp(G_last - G)      (decayed to the chunk end)
exp(-G) overflows for strong decays, so nothing is factored through the chunk start. The
chunk is cut into sub-chunks of SUB tokens with middle token m; one exp per token and
channel, x = exp(G - G_m), gives
    inside a sub-chunk:  exp(G_i - G_j) = x_i / x_j
    across sub-chunks:   exp(G_i - G_j) = [x_i exp(G_m(i) - r)] * [exp(r - G_m(j)) / x_j]
                         with r the decay at a sub-chunk end between j and i, so both
                         brackets are <= 1 (the chunk is split in halves, quarters, ... down
                         to sub-chunks, each level pairing a row block with the column block
                         just before it)
    exp(G) = x * exp(G_m),   exp(G_last - G) = exp(G_last - G_m) / x
so every term is a matmul of scaled rows. It is exact in fp32 (a product that underflows is
below fp32 resolution anyway) while x stays a normal float, i.e. while SUB / 2 per-token log
decays sum to more than -87. The caller clamps log decays at MIN_LOG_DECAY to stay there: a
decay of exp(-20) = 2e-9 per token already leaves less than fp32 resolution of the past
state next to the new write. A scalar gate per head (GDN) needs no factoring:
exp(G_i - G_j) is a [C, C] matrix.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

SUB = 8
MIN_LOG_DECAY = -20.0


class Intra(NamedTuple):
    A_kk: torch.Tensor  # [B, C, C] strictly lower triangular
    A_qk: torch.Tensor  # [B, C, C] lower triangular with the diagonal
    kq_in: torch.Tensor  # [B, C, 2, K]
    k_out: torch.Tensor  # [B, C, K]


def intra_chunk(kq: torch.Tensor, G: torch.Tensor) -> Intra:
    """kq [B, C, 2, K] (k then q per token); G [B, C, K] or [B, C, 1] cumulative log decay."""
    if G.shape[-1] == 1:
        return _scalar_gate(kq, G)
    B, C, _, K = kq.shape
    n = C // SUB
    Gs = G.view(B, n, SUB, K)
    Gm = Gs[:, :, (SUB - 1) // 2]  # [B, n, K] decay at each sub-chunk's middle token
    x = (Gs - Gm[:, :, None]).exp_()  # [B, n, SUB, K]
    rows = kq.view(B, n, SUB, 2, K) * x[:, :, :, None]  # [B, n, SUB, 2, K] [k, q] exp(G - G_m)
    cols = kq.view(B, n, SUB, 2, K)[:, :, :, 0] / x  # [B, n, SUB, K]  k exp(G_m - G)

    A = kq.new_empty(B, C, 2, C)  # [B, i, (kk, qk), j]; pairs above the sub-chunk diagonal stay unset
    blocks = torch.bmm(rows.view(B * n, 2 * SUB, K), cols.view(B * n, SUB, K).transpose(1, 2))
    A.view(B, n, SUB, 2, n, SUB).diagonal(dim1=1, dim2=4).copy_(
        blocks.view(B, n, SUB, 2, SUB).permute(0, 2, 3, 4, 1))

    e = Gs[:, :, -1]  # [B, n, K] decay at each sub-chunk's end
    b = C // 2
    while b >= SUB:
        _cross_blocks(A, rows, cols, Gm, e, b)
        b //= 2

    kq_in = (rows * Gm.exp()[:, :, None, None]).view(B, C, 2, K)
    k_out = (cols * (e[:, -1:] - Gm).exp()[:, :, None]).view(B, C, K)
    return Intra(A[:, :, 0].tril(-1), A[:, :, 1].tril(), kq_in, k_out)


def _cross_blocks(A, rows, cols, Gm, e, b):
    """Fill A at rows [2pb + b, 2pb + 2b) x cols [2pb, 2pb + b) for every p, factoring
    exp(G_i - G_j) at r = the decay at the end of the column block."""
    B, n, _, _, K = rows.shape
    P, nb = n * SUB // (2 * b), b // SUB
    r = e.view(B, P, 2, nb, K)[:, :, 0, -1:]  # [B, P, 1, K]
    Gm = Gm.view(B, P, 2, nb, K)
    left = cols.view(B, P, 2, nb, SUB, K)[:, :, 0] * (r - Gm[:, :, 0]).exp()[..., None, :]  # [B, P, nb, SUB, K]
    right = rows.view(B, P, 2, nb, SUB, 2, K)[:, :, 1] * (Gm[:, :, 1] - r).exp()[..., None, None, :]  # ..., 2, K
    blocks = torch.bmm(right.view(B * P, 2 * b, K), left.view(B * P, b, K).transpose(1, 2))  # [B*P, 2b, b]
    A.view(B, P, 2, b, 2, P, 2, b).diagonal(dim1=1, dim2=5)[:, 1, :, :, 0].copy_(
        blocks.view(B, P, b, 2, b).permute(0, 2, 3, 4, 1))


def _scalar_gate(kq, G):
    B, C, _, K = kq.shape
    k = kq[:, :, 0]  # [B, C, K]
    lower = torch.ones(C, C, dtype=torch.bool, device=kq.device).tril()
    decay = (G - G.transpose(1, 2)).masked_fill(~lower, float("-inf")).exp()  # [B, C, C]
    A = torch.bmm(kq.view(B, 2 * C, K), k.transpose(1, 2)).view(B, C, 2, C) * decay[:, :, None]
    kq_in = kq * G.exp()[:, :, None]
    k_out = k * (G[:, -1:] - G).exp()
    return Intra(A[:, :, 0].tril(-1), A[:, :, 1].tril(), kq_in, k_out)


def unit_lower_inverse(N: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for N [B, C, C] strictly lower triangular. The 8 x 8 diagonal blocks use
    (I + n)^-1 = (I - n)(I + n^2)(I + n^4) (n^8 = 0); larger blocks double the solved size:
    [[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]]."""
    B, C, _ = N.shape
    leaf = 8
    P = C // leaf
    n = N.view(B, P, leaf, P, leaf).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, P, leaf, leaf]
    eye = torch.eye(leaf, dtype=N.dtype, device=N.device)
    n2 = n @ n
    M = N.new_zeros(B, C, C)
    M.view(B, P, leaf, P, leaf).diagonal(dim1=1, dim2=3).copy_(
        ((eye - n) @ (eye + n2) @ (eye + n2 @ n2)).permute(0, 2, 3, 1))
    b = leaf
    while b < C:
        P = C // (2 * b)
        Mb, Nb = (x.view(B, P, 2 * b, P, 2 * b).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2) for x in (M, N))
        Mb[..., b:, :b] = -(Mb[..., b:, b:] @ Nb[..., b:, :b] @ Mb[..., :b, :b])  # [B, P, b, b]
        b *= 2
    return M
