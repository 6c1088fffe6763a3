"""Paged attention: torch path vs the naive reference, KV writes, chunked extend, CUDA path."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels.attention.torch as attn_torch
from kernels import dispatch
from kernels.attention import paged_attention, slot_mapping, write_kv
from kernels.attention.cuda import cuda_paged_attention, flash_unsupported
from kernels.attention.kv import read_kv
from kernels.attention.naive import naive_paged_attention
from tests.utils import rel_err

FP32_TOL = 1e-5
pytestmark = pytest.mark.usefixtures("prefill_impl")  # compiled prefill kernel and the torch path


class Batch(NamedTuple):
    q: torch.Tensor  # [T, H, Dk]
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, Dk]
    v_cache: torch.Tensor | None  # [num_pages, page_size, Hkv, Dv]
    page_table: torch.Tensor  # [N, P]
    cu_seqlens: torch.Tensor  # [N+1]
    seq_lens: torch.Tensor  # [N]

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.cu_seqlens, self.seq_lens)


def make_page_table(seq_lens, page_size, gen, spare=3):
    """Shuffled non-contiguous pages per sequence, unused entries -1 -> (table [N, P], pages)."""
    need = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(need) + spare
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seq_lens), max(need) + 1), -1, dtype=torch.long)
    start = 0
    for n, count in enumerate(need):
        table[n, :count] = perm[start : start + count]
        start += count
    return table, num_pages


def make_batch(seq_lens, q_lens, heads, page_size, dims=(16, 16), latent=False, dtype=torch.float32,
               seed=0):
    """Random queries and caches; every slot a sequence does not own holds stale random values."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv = heads
    dk, dv = dims
    table, num_pages = make_page_table(seq_lens, page_size, gen)
    k_cache = torch.randn(num_pages, page_size, hkv, dk, generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, page_size, hkv, dv, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), h, dk, generator=gen).to(dtype)
    cu = F.pad(torch.tensor(q_lens).cumsum(0), (1, 0))
    return Batch(q, k_cache, None if latent else v_cache, table, cu, torch.tensor(seq_lens))


def dense_causal(q, k, v, scale=None):
    """Causal attention of a whole sequence from contiguous q [L, H, D], k/v [L, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    )
    return o.transpose(0, 1)


# extend: prefixes 0, 16, 16, 3, 0 and a decode row; one sequence with no queries
EXTEND_SEQ = [7, 20, 33, 4, 16, 9]
EXTEND_Q = [7, 4, 17, 1, 16, 0]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_extend_matches_naive(page_size, group):
    """Varlen extend over shuffled pages (GQA ratio `group`) equals the per-sequence reference."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 4 // group), page_size)
    o = paged_attention(*b.args())
    assert o.shape == (sum(EXTEND_Q), 4, 16)
    assert rel_err(o, naive_paged_attention(*b.args())) < FP32_TOL


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch_matches_naive(page_size):
    """A decode batch (one query per sequence, different key counts) equals the reference."""
    b = make_batch([1, 2, 17, 40, 9, 33], [1] * 6, (8, 2), page_size, seed=1)
    o = paged_attention(*b.args(), scale=0.3)
    assert rel_err(o, naive_paged_attention(*b.args(), scale=0.3)) < FP32_TOL


def test_varlen_batch_equals_separate_runs():
    """Each sequence of a mixed extend/decode batch gets what it gets when run alone."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 2), 4, seed=2)
    o = paged_attention(*b.args())
    for n in range(len(EXTEND_SEQ)):
        s, e = b.cu_seqlens[n], b.cu_seqlens[n + 1]
        one = slice(n, n + 1)
        alone = paged_attention(b.q[s:e], *b.args()[1:3], b.page_table[one], None, b.seq_lens[one])
        assert rel_err(o[s:e], alone) < 1e-6


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_latent_layout(page_size):
    """v_cache=None with v_dim reads values from k_cache[..., :v_dim] (MQA, Dk != Dv)."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 1), page_size, dims=(24, 16), latent=True, seed=3)
    o = paged_attention(*b.args(), scale=0.2, v_dim=16)
    assert o.shape == (sum(EXTEND_Q), 4, 16)
    assert rel_err(o, naive_paged_attention(*b.args(), scale=0.2, v_dim=16)) < FP32_TOL
    explicit = b._replace(v_cache=b.k_cache[..., :16].clone())
    assert rel_err(o, paged_attention(*explicit.args(), scale=0.2)) < 1e-6


def shared_prefix_batch(cached, q_lens, heads, dims, shared_pages, page_size=16, latent=False, seed=11):
    """A batch whose page tables all start with the same `shared_pages` pages (a prefix cached
    once and read by every sequence; the last sequence must have that many), then pages of their
    own; sequence n has cached[n] keys before its q_lens[n] queries."""
    b = make_batch([c + e for c, e in zip(cached, q_lens)], q_lens, heads, page_size, dims, latent, seed=seed)
    table = b.page_table.clone()
    table[:, :shared_pages] = b.page_table[-1, :shared_pages]  # every sequence reads the last one's first pages
    return b._replace(page_table=table)


@pytest.mark.parametrize("heads,dims,latent", [((4, 2), (16, 16), False), ((4, 1), (24, 16), True)],
                         ids=["gqa", "mla"])
@pytest.mark.parametrize("cached,shared", [
    ([320, 330, 400, 321, 352, 500], 20),  # 20 shared pages (two key blocks), ends at, inside and past a page
    ([320, 330, 200, 321, 352, 500], 20),  # one sequence has cached fewer keys than the shared pages hold
    ([5, 330, 400, 321, 352, 500], 20),    # one has not a single whole page cached
])
def test_batch_over_a_shared_cached_prefix_matches_naive(heads, dims, latent, cached, shared):
    """Prefill segments (one past a query block of 64), decode rows and a segment with no queries
    whose page tables share their first pages (run for the whole batch at once by the compiled
    kernel, as far as every sequence has them cached) equal the reference, and equal what each
    sequence gets when it reads a private copy of those pages."""
    q_lens = [70, 1, 6, 1, 0, 130]
    b = shared_prefix_batch(cached, q_lens, heads, dims, shared, latent=latent)
    dv = dims[1] if latent else None
    o = paged_attention(*b.args(), scale=0.3, v_dim=dv)
    assert o.shape == (sum(q_lens), 4, 16)
    assert rel_err(o, naive_paged_attention(*b.args(), scale=0.3, v_dim=dv)) < FP32_TOL
    pages, n = b.page_table[-1, :shared], len(q_lens)
    copies = lambda c: None if c is None else torch.cat([c, c[pages].repeat(n - 1, 1, 1, 1)])  # noqa: E731
    table = b.page_table.clone()  # the others read their own copies of the last one's first pages
    table[:-1, :shared] = len(b.k_cache) + torch.arange((n - 1) * shared).view(n - 1, shared)
    private = b._replace(k_cache=copies(b.k_cache), v_cache=copies(b.v_cache), page_table=table)
    assert rel_err(o, paged_attention(*private.args(), scale=0.3, v_dim=dv)) < 1e-6


def test_dk_differs_from_dv_with_separate_caches():
    """Separate K and V caches with Dk != Dv match the reference."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 2), 16, dims=(24, 8), seed=4)
    assert rel_err(paged_attention(*b.args()), naive_paged_attention(*b.args())) < FP32_TOL


def test_query_blocks(monkeypatch):
    """Cutting long query blocks into Q_BLOCK pieces changes nothing."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 2), 4, seed=5)
    whole = paged_attention(*b.args())
    monkeypatch.setattr(attn_torch, "Q_BLOCK", 3)
    assert rel_err(paged_attention(*b.args()), whole) < 1e-6
    assert rel_err(paged_attention(*b.args()), naive_paged_attention(*b.args())) < FP32_TOL


def test_bf16_inputs():
    """bf16 in gives bf16 out, within bf16 rounding of the fp32 reference on the same values."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 2), 16, dtype=torch.bfloat16, seed=6)
    o = paged_attention(*b.args())
    assert o.dtype == torch.bfloat16
    ref = naive_paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), *b.args()[3:])
    assert rel_err(o, ref) < 1e-2


@pytest.mark.parametrize("heads,dims,latent", [((4, 2), (64, 64), False), ((4, 4), (96, 64), False),
                                               ((4, 1), (160, 128), True)], ids=["gqa", "mla-expanded", "mla"])
def test_bf16_at_model_sizes(heads, dims, latent):
    """bf16 at the peer models' head sizes (where CPUs with bf16 micro-kernels run the compiled
    kernel over packed 128-key blocks): sequences that end inside, at and one past a key block,
    query blocks cut inside a sequence, cached prefixes and decode rows, all within bf16 rounding
    of the fp32 reference on the same values."""
    seq_lens, q_lens = [300, 129, 256, 70, 1, 200], [300, 65, 3, 6, 1, 0]
    b = make_batch(seq_lens, q_lens, heads, 16, dims, latent, dtype=torch.bfloat16, seed=11)
    dv = dims[1] if latent else None
    o = paged_attention(*b.args(), scale=dims[0] ** -0.5, v_dim=dv)
    up = lambda t: None if t is None else t.float()  # noqa: E731
    ref = naive_paged_attention(b.q.float(), b.k_cache.float(), up(b.v_cache), *b.args()[3:], scale=dims[0] ** -0.5,
                                v_dim=dv)
    assert o.dtype == torch.bfloat16 and rel_err(o, ref) < 1e-2


def test_slot_mapping_by_hand():
    """Slots are page * page_size + row of each new token's position (hand-computed case)."""
    table = torch.tensor([[3, 0, -1], [5, 1, 2]])
    # seq 0: 3 keys, queries at positions 1, 2; seq 1: 5 keys, one query at position 4
    slots = slot_mapping(table, torch.tensor([0, 2, 3]), torch.tensor([3, 5]), page_size=2)
    assert slots.tolist() == [3 * 2 + 1, 0 * 2 + 0, 2 * 2 + 0]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("latent", [False, True])
def test_write_then_read(page_size, latent):
    """write_kv puts each new token where read_kv finds it and touches no other slot."""
    b = make_batch([5, 20, 33], [5, 4, 17], (4, 2), page_size, latent=latent, seed=7)
    t = b.q.shape[0]
    k = torch.randn(t, 2, 16)
    v = None if latent else torch.randn(t, 2, 16)
    before = [c.clone() for c in (b.k_cache, b.v_cache) if c is not None]
    slots = slot_mapping(b.page_table, b.cu_seqlens, b.seq_lens, page_size)
    write_kv(b.k_cache, b.v_cache, slots, k, v)
    for cache, new, old in zip((b.k_cache, b.v_cache), (k, v), before):
        for n in range(3):
            s, e = b.cu_seqlens[n], b.cu_seqlens[n + 1]
            got = read_kv(cache, b.page_table[n : n + 1], int(b.seq_lens[n]))[0]  # [L, Hkv, D]
            assert torch.equal(got[-(e - s) :], new[s:e])
        untouched = torch.ones(cache.shape[0] * page_size, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(cache.flatten(0, 1)[untouched], old.flatten(0, 1)[untouched])


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_extend_equals_one_shot(page_size):
    """Rounds of (write new K/V, attend over prefix pages + new block) equal causal attention
    over each whole sequence computed from contiguous tensors."""
    lens, cuts = [37, 50, 20], [[0, 13, 29, 37], [0, 16, 17, 50], [0, 1, 2, 20]]
    gen = torch.Generator().manual_seed(8)
    table, num_pages = make_page_table(lens, page_size, gen)
    k_cache = torch.randn(num_pages, page_size, 2, 16, generator=gen)
    v_cache = torch.randn(num_pages, page_size, 2, 16, generator=gen)
    q, k, v = ([torch.randn(n, h, 16, generator=gen) for n in lens] for h in (4, 2, 2))
    out = [[] for _ in lens]
    for r in range(3):
        spans = [(c[r], c[r + 1]) for c in cuts]
        cu = F.pad(torch.tensor([e - s for s, e in spans]).cumsum(0), (1, 0))
        seq_lens = torch.tensor([e for _, e in spans])
        slots = slot_mapping(table, cu, seq_lens, page_size)
        q_new, k_new, v_new = (torch.cat([x[n][s:e] for n, (s, e) in enumerate(spans)])
                               for x in (q, k, v))
        write_kv(k_cache, v_cache, slots, k_new, v_new)
        o = paged_attention(q_new, k_cache, v_cache, table, cu, seq_lens)
        for n in range(3):
            out[n].append(o[cu[n] : cu[n + 1]])
    for n in range(3):
        assert rel_err(torch.cat(out[n]), dense_causal(q[n], k[n], v[n])) < FP32_TOL


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 9)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 3, 8]),
    group=st.sampled_from([1, 2]),
)
def test_random_batches_match_naive(rows, page_size, group):
    """Any mix of (prefix, new) per sequence matches the reference."""
    seq = [max(p + e, 1) for p, e in rows]
    new = [min(e, s) for (_, e), s in zip(rows, seq)]
    b = make_batch(seq, new, (2, 2 // group), page_size, dims=(8, 8), seed=9)
    assert rel_err(paged_attention(*b.args()), naive_paged_attention(*b.args())) < FP32_TOL


def test_bad_arguments_raise():
    """Malformed calls raise ValueError naming the argument."""
    b = make_batch([8, 4], [3, 1], (4, 2), 4)
    with pytest.raises(ValueError, match="Hkv"):
        paged_attention(b.q[:, :3], b.k_cache[..., :16], b.v_cache, *b.args()[3:])
    with pytest.raises(ValueError, match="v_dim"):
        paged_attention(b.q, b.k_cache, None, *b.args()[3:])
    with pytest.raises(ValueError, match="v_dim"):
        paged_attention(*b.args(), v_dim=8)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(*b.args()[:5], torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        paged_attention(*b.args()[:4], torch.tensor([0, 4]), torch.tensor([8, 4]))
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention(b.q, b.k_cache, b.v_cache[:, :2], *b.args()[3:])
    with pytest.raises(ValueError, match="v must be given"):
        write_kv(b.k_cache, b.v_cache, torch.tensor([0]), b.k_cache[0, :1])


def test_flash_unsupported_names_the_reason():
    """flash_unsupported names why flash-attn 2 cannot run: dtype, page size, Dk != Dv, device."""
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    kc = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    assert "dtype" in flash_unsupported(q.float(), kc.float(), kc.float())
    assert "page_size 16" in flash_unsupported(q, kc[:, :16], kc[:, :16])
    assert "Dk=64 != Dv=32" in flash_unsupported(q, kc, None, v_dim=32)
    assert "CUDA" in flash_unsupported(q, kc, kc)


def test_cuda_entry_falls_back_on_cpu():
    """cuda_paged_attention on tensors it cannot take returns exactly the torch path's result."""
    b = make_batch(EXTEND_SEQ, EXTEND_Q, (4, 2), 16, seed=10)
    with pytest.warns(UserWarning, match="torch path: dtype torch.float32"):
        o = cuda_paged_attention(*b.args())
    assert torch.equal(o, paged_attention(*b.args()))


def test_dispatch_registry():
    """dispatch maps attention on cpu/cuda to these functions."""
    assert dispatch.get("attention", "cpu") is paged_attention
    assert dispatch.get("attention", "cuda") is cuda_paged_attention


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [256, 16])
def test_cuda_matches_naive(page_size):
    """On CUDA (flash-attn for 256-token pages when installed, else the torch path) bf16
    extend + decode matches the fp32 reference."""
    b = make_batch([300, 520, 40, 257], [300, 8, 1, 1], (8, 2), page_size, dims=(64, 64),
                   dtype=torch.bfloat16, seed=11)
    dev = Batch(*(x.cuda() for x in b))
    o = cuda_paged_attention(*dev.args())
    ref = naive_paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), *b.args()[3:])
    assert rel_err(o.cpu(), ref) < 2e-2


@pytest.mark.gpu
def test_cuda_mla_latent_falls_back():
    """MLA latent layout on CUDA (Dk != Dv) runs the torch path and matches the reference."""
    b = make_batch([40, 9], [8, 1], (4, 1), 16, dims=(72, 64), latent=True, dtype=torch.bfloat16,
                   seed=12)
    dev = Batch(*(None if x is None else x.cuda() for x in b))
    o = cuda_paged_attention(*dev.args(), v_dim=64)
    ref = naive_paged_attention(b.q.float(), b.k_cache.float(), None, *b.args()[3:], v_dim=64)
    assert rel_err(o.cpu(), ref) < 2e-2
