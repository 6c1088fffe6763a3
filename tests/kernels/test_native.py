"""The compiled CPU kernels equal the torch formulations they replace."""
import math

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from kernels.attention.kv import read_kv
from kernels.attention.torch import _decode, decode
from tests.kernels.test_attention import make_batch

needs_kernel = pytest.mark.skipif(native.extension() is None, reason="CPU decode kernel not built here")


def check_decode(lens, heads, dims, page_size, layout, dtype):
    """The kernel's decode of one query per sequence (random pages) equals the fp32 reference."""
    b = make_batch(lens, [1] * len(lens), heads, page_size, dims=dims, latent=layout == "mla", dtype=dtype)
    seq_lens = torch.tensor(lens)
    v_rows = b.k_cache if b.v_cache is None else b.v_cache
    got = native.paged_decode(b.q, b.k_cache, v_rows, b.page_table, seq_lens, 0.3, dims[1])
    k = read_kv(b.k_cache, b.page_table, max(lens))
    v = k[..., : dims[1]] if b.v_cache is None else read_kv(b.v_cache, b.page_table, max(lens))
    want = _decode(b.q.float(), k.float(), v.float(), seq_lens, 0.3)  # fp32 reference of the same inputs
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_kernel_equals_torch_decode(dtype, layout, page_size):
    """Reading the pages in place (kernel) and gathering them (torch) give the same outputs for
    one query per sequence, over ragged lengths, GQA groups and the MLA latent layout."""
    heads = {"mha": (4, 4), "gqa": (6, 2), "mla": (4, 1)}[layout]
    dims = (24, 16) if layout == "mla" else (16, 16)
    lens = [1, 5, 33, 17, 64]
    check_decode(lens, heads, dims, page_size, layout, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("page_size", [1, 48])
def test_decode_over_several_key_steps(dtype, layout, page_size):
    """A sequence's own keys run in steps of up to 256 keys (whole pages: 240 at 48 a page), the
    online softmax carried from step to step: lengths on both sides of a step's end, and longer
    than two steps, equal the reference."""
    heads = (6, 2) if layout == "gqa" else (4, 1)
    dims = (24, 16) if layout == "mla" else (16, 16)
    lens = [239, 240, 241, 256, 257, 600]
    check_decode(lens, heads, dims, page_size, layout, dtype)


@needs_kernel
@pytest.mark.parametrize("heads,dims", [((4, 2), (64, 64)), ((6, 2), (64, 64)), ((16, 2), (64, 128)),
                                        ((4, 1), (160, 128))], ids=["gqa-2", "gqa-3", "gqa-8", "mla-latent"])
@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_decode_at_model_widths(heads, dims, page_size):
    """bf16 at the models' widths (key width a multiple of 32, value width of 64), where a
    sequence's own keys run through AVX-512 BF16 on CPUs that have it: 16 keys' scores at a time
    and the value rows summed in registers, 4 query heads at a time (8 per KV head: two groups).
    Lengths off and on the 16-key groups and the 256-key steps equal the fp32 reference of the
    same bf16 inputs to fp32 rounding (1e-4, a hundred times tighter than bf16's step)."""
    lens = [1, 5, 16, 17, 239, 240, 257, 600]
    b = make_batch(lens, [1] * len(lens), heads, page_size, dims=dims, latent=heads[1] == 1, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens)
    v_rows = b.k_cache if b.v_cache is None else b.v_cache
    got = native.paged_decode(b.q, b.k_cache, v_rows, b.page_table, seq_lens, 0.3, dims[1])
    k = read_kv(b.k_cache, b.page_table, max(lens))
    v = k[..., : dims[1]] if b.v_cache is None else read_kv(b.v_cache, b.page_table, max(lens))
    torch.testing.assert_close(got, _decode(b.q.float(), k.float(), v.float(), seq_lens, 0.3), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gqa", "mla", "gqa-64", "mla-160"])
@pytest.mark.parametrize("lens,shared", [([40, 33, 70, 36], 2), ([40, 12, 70, 36], 2), ([32, 32, 32], 2),
                                         ([330 + i % 7 for i in range(50)], 20)])
def test_decode_over_pages_shared_by_every_sequence(dtype, layout, lens, shared):
    """Sequences whose page tables start with the same pages (a prefix cached once): those pages
    run as matmuls over all sequences' queries, the rest per sequence, and the result equals the
    reference. Shared pages count only while every sequence fills them (12 keys: none; 32: the
    first two of 16, with nothing after them); 20 shared pages are two steps of keys, and 50
    sequences more query rows than one job takes. At the models' widths (values a multiple of 32
    wide) bf16 shared pages run over packed key blocks where the CPU has AVX-512 BF16 without AMX."""
    gen = torch.Generator().manual_seed(3)
    ps = 16
    heads, dims = {"gqa": ((6, 2), (16, 16)), "mla": ((4, 1), (24, 16)), "gqa-64": ((4, 2), (64, 64)),
                   "mla-160": ((4, 1), (160, 128))}[layout]
    layout = layout.split("-")[0]
    own = [(n - 1) // ps + 1 - shared for n in lens]  # pages past the shared ones
    num_pages = shared + sum(max(o, 0) for o in own)
    order = torch.randperm(num_pages - shared, generator=gen) + shared
    table, at = torch.zeros(len(lens), max(own) + shared, dtype=torch.long), 0
    for i, o in enumerate(own):
        table[i, :shared] = torch.arange(shared).flip(0)  # the shared pages, last first
        table[i, shared : shared + max(o, 0)] = order[at : at + max(o, 0)]
        at += max(o, 0)
    k_cache = torch.randn(num_pages, ps, heads[1], dims[0], generator=gen).to(dtype)
    v_cache = torch.randn(num_pages, ps, heads[1], dims[1], generator=gen).to(dtype)
    v_rows = k_cache if layout == "mla" else v_cache
    q = torch.randn(len(lens), heads[0], dims[0], generator=gen).to(dtype)
    seq_lens = torch.tensor(lens)
    got = native.paged_decode(q, k_cache, v_rows, table, seq_lens, 0.3, dims[1])
    k = read_kv(k_cache, table, max(lens))
    v = k[..., : dims[1]] if layout == "mla" else read_kv(v_cache, table, max(lens))
    want = _decode(q.float(), k.float(), v.float(), seq_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_decode_falls_back_to_torch(monkeypatch):
    """Without the kernel (not built, or HYBRIDSERVE_NATIVE=0) decode gathers and computes the same."""
    lens = [3, 40, 9]
    b = make_batch(lens, [1, 1, 1], (4, 2), 16)
    seq_lens = torch.tensor(lens)
    with_kernel = decode(b.q, b.k_cache, b.v_cache, b.page_table, seq_lens, 0.25, 16)
    monkeypatch.setattr("kernels.attention.torch.paged_decode", lambda *a: None)
    without = decode(b.q, b.k_cache, b.v_cache, b.page_table, seq_lens, 0.25, 16)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)


def _step_inputs(gate, gen, hv, k_dim, v_dim, n=5, h=2):
    """q, k (unit rows) [n, h, K], v [n, HV, V], log decays g [n, HV, K or 1], beta [n, HV]."""
    q, k = (F.normalize(torch.randn(n, h, k_dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(n, hv, v_dim, generator=gen)
    g = -torch.rand(n, hv, k_dim if gate == "kda" else 1, generator=gen)
    return q, k, v, g, torch.rand(n, hv, generator=gen)


@needs_kernel
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_delta_step_updates_slots_in_place(gate):
    """The compiled delta-rule step equals the torch step (kernels/kda/recurrent.py) on the
    states of the named slots, writes them in place, and leaves every other slot as it was."""
    from kernels.kda.recurrent import delta_step

    gen = torch.Generator().manual_seed(1)
    hv, k_dim, v_dim = 4, 16, 8
    q, k, v, g, beta = _step_inputs(gate, gen, hv, k_dim, v_dim)
    state = torch.randn(10, hv, k_dim, v_dim, generator=gen)
    slots = torch.tensor([3, 7, 0, 9, 4])
    want_o, want_s = delta_step(q, k, v, g, beta, k_dim**-0.5, state[slots])
    after = state.clone()
    o = native.delta_step(q, k, v, g, beta, after, slots, k_dim**-0.5)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[slots], want_s, rtol=1e-5, atol=1e-5)
    others = [i for i in range(10) if i not in slots.tolist()]
    assert torch.equal(after[others], state[others])


@needs_kernel
@pytest.mark.parametrize("ta", [False, True], ids=["a", "a^T"])
@pytest.mark.parametrize("tb", [False, True], ids=["b", "b^T"])
@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (-1.0, 1.0), (0.5, -2.0)])
def test_kernel_matmul_equals_fp64_matmul(ta, tb, alpha, beta):
    """The kernels' mm (small_mm's register tiles at these sizes on AVX-512 or AVX2, else the BLAS)
    at every tail its tiles have (rows 1-17 and a few blocks of them, columns 1-130 around the
    vectors and panels: 16 and 64 wide on AVX-512, 8 and 16 on AVX2), strided rows, and large
    products that go to the BLAS: alpha op(A) op(B) + beta C within fp32 summation error of
    fp64; with beta 0, C is not read (NaN there stays out)."""
    gen = torch.Generator().manual_seed(int(ta) + 2 * int(tb))
    for m, n, k in [(1, 1, 1), (5, 16, 3), (17, 17, 64), (13, 33, 100), (64, 64, 64), (128, 130, 64),
                    (6, 48, 7), (9, 200, 5), (300, 600, 40)]:
        a = torch.randn(k, m + 3, generator=gen)[:, :m] if ta else torch.randn(m, k + 3, generator=gen)[:, :k]
        b = torch.randn(n, k, generator=gen) if tb else torch.randn(k, n, generator=gen)
        c = torch.full((m, n), float("nan")) if beta == 0 else torch.randn(m, n, generator=gen)
        want = alpha * ((a.T if ta else a).double() @ (b.T if tb else b).double()) + (beta * c.double() if beta else 0)
        native.extension().matmul(ta, tb, alpha, a, b, beta, c)
        torch.testing.assert_close(c.double(), want, rtol=0, atol=1e-5 * k**0.5 * (1 + abs(beta)))


def _chunk_both(op, dtype, fast=True, monkeypatch=None):
    from kernels.gdn import chunk_gdn
    from kernels.kda import chunk_kda
    from tests.kernels.fla_interpret import make_inputs

    fn = {"kda": chunk_kda, "gdn": chunk_gdn}[op]
    q, k, v, g, beta, h0, cu = make_inputs([150, 0, 64, 1, 97], op == "gdn", H=2, HV=4, K=32, V=16)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    args = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu,
                checkpoint_at=torch.tensor([64, 150, 214, 128, 215, 312]))
    old = native.extension().matmul_fast(fast)
    try:
        compiled = fn(q, k, v, g, beta, **args)
    finally:
        native.extension().matmul_fast(old)
    monkeypatch.setattr(native, "chunk_delta_rule", lambda *a: None)
    return compiled, fn(q, k, v, g, beta, **args)


def _delta_rule_fp64(q, k, v, g, beta, scale):
    """The gated delta rule token by token in float64, log decays clamped at -20 as the kernels do."""
    q, k, v, beta = (x.double() for x in (q, k, v, beta))
    g = g.double().clamp(min=-20.0)
    S = torch.zeros(v.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    o = torch.zeros(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        S = S + torch.einsum("hk,hv->hkv", k[t], beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t])))
        o[t] = scale * torch.einsum("hkv,hk->hv", S, q[t])
    return o


@needs_kernel
@pytest.mark.parametrize("max_decay, far_channels", [(0.5, 0), (0.5, 5), (3.6, 0), (40.0, 0)],
                         ids=["weak", "weak-and-5-strong-channels", "near-the-bound", "strong"])
def test_kda_chunk_kernel_accurate_to_fp64_on_strong_decays(max_decay, far_channels):
    """The compiled KDA chunk kernel at Kimi's head size (64) is within 1e-6 of a float64 token
    loop, with log decays down to -40 per token too (clamped at -20). Its pair factoring keeps
    every factor in fp32's normal range: factored over 8 tokens, a key times e^-80 fell below it,
    flushed to zero beside a partner factor of e^+80, and the outputs were off by 1.2e-5. Channels
    whose decay over a chunk is within the kernel's bound (60) share one reference and the others
    go through the blocked factoring: weak decays (every channel under it), a few channels of -20
    per token among weak ones (both kinds in every chunk), decays up to -3.6 (chunks on both sides
    of the bound) and strong ones (every channel past it)."""
    from kernels.kda import chunk_kda

    torch.manual_seed(0)
    T, H, K = 256, 4, 64
    q, k = (F.normalize(torch.randn(T, H, K), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(T, H, K), -torch.rand(T, H, K) * max_decay, torch.rand(T, H)
    g[..., :far_channels] = -20.0 + torch.rand(T, H, far_channels)
    o, _ = chunk_kda(q, k, v, g, beta, scale=K**-0.5, output_final_state=True)
    assert (o.double() - _delta_rule_fp64(q, k, v, g, beta, K**-0.5)).abs().max().item() < 1e-6


@needs_kernel
@pytest.mark.parametrize("op", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "loops"])
def test_chunk_kernel_equals_torch_chunk(op, dtype, fast, monkeypatch):
    """The compiled chunkwise delta rule (its matmuls through small_mm and torch's BLAS, or plain loops)
    gives the torch chunk path's outputs, final states and checkpoint states on a varlen batch
    with empty, one-token and chunk-aligned sequences, reading bf16 inputs as the torch path
    upcasts them."""
    compiled, reference = _chunk_both(op, dtype, fast, monkeypatch)
    for got, want in zip(compiled, reference):
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 2e-5 if got.dtype == torch.float32 else 1e-2  # bf16 outputs: one rounding apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_chunk_kernel_in_pool_slots_equals_gathered_states(op):
    """chunk_in_place on a pool of states (sequences in scattered slots, two of them starting from
    zeros whatever their slots held, checkpoints written into other slots) gives the same outputs,
    final states and checkpoint states, bit for bit, as the kernel on gathered states; the pool's
    other slots are untouched. Bad slots (repeated, or out of range) and a checkpoint of no
    sequence are refused before anything is written."""
    from kernels.kda.chunk import chunk_in_place
    from tests.kernels.fla_interpret import make_inputs

    q, k, v, g, beta, h0, cu = make_inputs([150, 0, 64, 1, 97], op == "gdn", H=2, HV=4, K=32, V=16)
    g = g if g.dim() == 3 else g[..., None]
    at = torch.tensor([64, 150, 214, 128, 215, 312])
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(12, *h0.shape[1:], generator=gen)
    slots, fresh, ck_slots = torch.tensor([7, 2, 9, 0, 4]), torch.tensor([False, True, False, True, False]), \
        torch.tensor([11, 3, 5, 1, 8, 10])
    pool[slots[~fresh]] = h0[~fresh]
    init = torch.where(fresh[:, None, None, None], 0.0, h0)
    want_o, want_states = native.chunk_delta_rule(q, k, v, g, beta, init, cu, _checkpoint_rows(at, cu), 32**-0.5, -20.0)
    before = pool.clone()
    o = chunk_in_place(q, k, v, g, beta, pool, slots, fresh, cu, at, ck_slots)
    assert torch.equal(o, want_o) and torch.equal(pool[slots], init) and torch.equal(pool[ck_slots], want_states)
    others = [i for i in range(12) if i not in slots.tolist() + ck_slots.tolist()]
    assert torch.equal(pool[others], before[others])
    for bad in (torch.tensor([7, 2, 9, 0, 7]), torch.tensor([7, 2, 9, 0, 12])):
        copy = pool.clone()
        with pytest.raises(RuntimeError, match="slots"):
            chunk_in_place(q, k, v, g, beta, copy, bad, fresh, cu, at, ck_slots)
        assert torch.equal(copy, pool)
    with pytest.raises(RuntimeError, match="checkpoint_slots"):
        chunk_in_place(q, k, v, g, beta, pool.clone(), slots, fresh, cu, at, torch.tensor([11, 3, 5, 1, 8, 7]))
    copy = pool.clone()
    with pytest.raises(RuntimeError, match="checkpoint's sequence out of range"):  # 5 sequences: 0..4
        native.chunk_delta_rule(q, k, v, g, beta, copy, cu, torch.tensor([[5, 64]]), 32**-0.5, -20.0, slots, fresh,
                                torch.tensor([11]))
    assert torch.equal(copy, pool)


@needs_kernel
@pytest.mark.parametrize("gate", ["kda", "gdn"])
def test_delta_step_on_bf16_states_is_the_fp32_step_rounded(gate):
    """On a bf16 state pool the compiled step computes in fp32 what it computes on the widened
    states and stores the result rounded to bf16 (to nearest even, as torch rounds): outputs and
    states bit for bit; other slots untouched."""
    gen = torch.Generator().manual_seed(2)
    hv, k_dim, v_dim = 4, 16, 24
    q, k, v, g, beta = _step_inputs(gate, gen, hv, k_dim, v_dim)
    pool = torch.randn(10, hv, k_dim, v_dim, generator=gen).bfloat16()
    slots = torch.tensor([3, 7, 0, 9, 4])
    wide = pool.float()
    want_o = native.delta_step(q, k, v, g, beta, wide, slots, k_dim**-0.5)
    after = pool.clone()
    o = native.delta_step(q, k, v, g, beta, after, slots, k_dim**-0.5)
    assert torch.equal(o, want_o)
    assert torch.equal(after[slots], wide[slots].bfloat16())
    assert not torch.equal(after[slots], pool[slots])  # the step did move them
    others = [i for i in range(10) if i not in slots.tolist()]
    assert torch.equal(after[others], pool[others])


@needs_kernel
@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_chunk_kernel_on_bf16_states_rounds_after_every_chunk(op):
    """On a bf16 state pool the chunk kernel gives, bit for bit, what fp32 calls of one 64-token
    step each give (two of the kernel's 32-token chunks) with the state rounded to bf16 between
    them: its outputs, final states and checkpoint states (in bf16 rows of the pool). So splitting
    a prefill at those boundaries, or resuming it from a checkpoint, changes nothing."""
    from kernels.kda.chunk import chunk_in_place
    from tests.kernels.fla_interpret import make_inputs

    lengths = [150, 64, 1, 97]
    q, k, v, g, beta, h0, cu = make_inputs(lengths, op == "gdn", H=2, HV=4, K=32, V=16)
    g = g if g.dim() == 3 else g[..., None]
    at = torch.tensor([64, 150, 128, 215])  # global positions: 64 and 128 of the first sequence, ends
    slots, fresh, ck_slots = torch.tensor([5, 2, 0, 7]), torch.tensor([False, True, False, False]), \
        torch.tensor([1, 3, 6, 4])
    pool = torch.zeros(8, *h0.shape[1:], dtype=torch.bfloat16)
    pool[slots] = h0.bfloat16()
    o = chunk_in_place(q, k, v, g, beta, pool, slots, fresh, cu, at, ck_slots)

    want_o, finals, states = [], [], {}
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s = torch.zeros_like(h0[n:n + 1]) if fresh[n] else h0[n:n + 1].bfloat16().float()
        for t in range(a, b, 64):
            c = min(64, b - t)
            rows = slice(t, t + c)
            out, _ = native.chunk_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], s,
                                             torch.tensor([0, c]), torch.zeros(0, 2, dtype=torch.int64),
                                             32**-0.5, -20.0)
            s = s.bfloat16().float()  # advanced in place by the call, then rounded
            want_o.append(out)
            states[t + c] = s.clone()
        finals.append(s[0])
    assert torch.equal(o, torch.cat(want_o).to(o.dtype))
    assert torch.equal(pool[slots].float(), torch.stack(finals))
    for pos, slot in zip(at.tolist(), ck_slots.tolist()):
        assert torch.equal(pool[slot].float(), states[pos][0]), pos


@needs_kernel
def test_ssd_kernel_in_pool_slots_equals_gathered_states():
    """chunk_ssd_in_place on a pool of states (scattered slots, one sequence starting from zeros,
    checkpoints into other slots) gives the kernel's outputs, final and checkpoint states on
    gathered states, bit for bit; the pool's other slots are untouched; repeated slots and a
    checkpoint of no sequence refused before anything is written."""
    from kernels.mamba2.chunk import chunk_ssd_in_place
    from kernels.mamba2.varlen import locate_checkpoints
    from tests.kernels.test_mamba2 import cu_of, make_inputs, random_state

    lengths = [70, 0, 1, 33, 64]
    x = make_inputs(sum(lengths))
    cu, at, h0 = cu_of(lengths), torch.tensor([32, 64, 70, 71, 104, 136, 168]), random_state(len(lengths))
    where = locate_checkpoints(at, cu, multiple_of=32)
    init = h0.clone()
    init[0] = 0
    want = native.chunk_ssd(*x, init, cu, torch.stack([where.seq, where.offset], dim=1), 32)
    pool = torch.randn(14, *h0.shape[1:], generator=torch.Generator().manual_seed(0))
    slots, fresh, ck_slots = torch.tensor([7, 2, 9, 0, 4]), torch.tensor([True, False, False, False, False]), \
        torch.tensor([11, 3, 5, 1, 8, 10, 13])
    pool[slots[1:]] = h0[1:]
    before = pool.clone()
    y = chunk_ssd_in_place(*x, pool, slots, fresh, cu, at, ck_slots, chunk_size=32)
    assert torch.equal(y, want[0]) and torch.equal(pool[slots], init) and torch.equal(pool[ck_slots], want[1])
    others = [i for i in range(14) if i not in slots.tolist() + ck_slots.tolist()]
    assert torch.equal(pool[others], before[others])
    with pytest.raises(RuntimeError, match="slots"):
        chunk_ssd_in_place(*x, pool.clone(), torch.tensor([7, 2, 9, 0, 2]), fresh, cu, at, ck_slots, chunk_size=32)
    copy = pool.clone()
    with pytest.raises(RuntimeError, match="checkpoint's sequence out of range"):  # 5 sequences: 0..4
        native.chunk_ssd(*x, copy, cu, torch.tensor([[-1, 32]]), 32, slots, fresh, torch.tensor([11]))
    assert torch.equal(copy, pool)


def _checkpoint_rows(at, cu):
    from kernels.kda.common import check_checkpoints

    cp = check_checkpoints(at, cu.tolist())
    return torch.stack([cp.seq, cp.length], dim=1)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_kernel_equals_torch_conv(dtype, activation, monkeypatch):
    """The compiled causal conv1d gives the torch path's outputs, final and checkpoint conv
    states on a varlen batch whose sequences are shorter than, equal to and longer than the
    window (the state is read there), with and without bias."""
    from kernels.conv1d import causal_conv1d

    gen = torch.Generator().manual_seed(3)
    lengths, D, W = [1, 3, 0, 40, 2], 24, 4
    x = torch.randn(sum(lengths), D, generator=gen).to(dtype)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    state = torch.randn(len(lengths), D, W - 1, generator=gen).to(dtype)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    for b in (bias, None):
        args = (x, weight, b, state, cu, activation, torch.tensor([1, 2, 4, 10, 44, 46]))
        compiled = causal_conv1d(*args)
        with monkeypatch.context() as m:
            m.setattr(native, "causal_conv1d", lambda *a: None)
            reference = causal_conv1d(*args)
        for got, want in zip(compiled, reference):
            assert got.dtype == want.dtype and got.shape == want.shape
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_conv_kernel_in_pool_slots_equals_gathered_states(dtype, state_dtype):
    """conv_in_place on a pool of conv states (sequences in scattered slots, one of them starting
    from zeros whatever its slot held, checkpoints written into other slots) gives, bit for bit,
    the outputs, final states and checkpoint states of causal_conv1d on the gathered states (its
    states rounded to the pool's dtype); the pool's other slots are untouched. Repeated or out of
    range slots are refused before anything is written."""
    from kernels.conv1d.torch import causal_conv1d, conv_in_place

    gen = torch.Generator().manual_seed(5)
    lengths, D, W = [1, 3, 0, 40, 2], 24, 4
    x = torch.randn(sum(lengths), D + 8, generator=gen).to(dtype)[:, 4 : 4 + D]  # a column range
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    cu, at = torch.tensor([0, *lengths]).cumsum(0), torch.tensor([1, 2, 4, 10, 44, 46])
    pool = torch.randn(13, D, W - 1, generator=gen).to(state_dtype)
    slots, fresh, ck_slots = torch.tensor([7, 2, 9, 0, 4]), torch.tensor([False, True, False, False, False]), \
        torch.tensor([11, 3, 5, 1, 8, 10])
    init = pool[slots].clone()
    init[fresh] = 0
    want_y, want_final, want_states = causal_conv1d(x, weight, bias, init, cu, "silu", at)
    before = pool.clone()
    y = conv_in_place(x, weight, bias, "silu", pool, slots, fresh, cu, at, ck_slots)
    assert torch.equal(y, want_y) and torch.equal(pool[slots], want_final) and torch.equal(pool[ck_slots], want_states)
    others = [i for i in range(13) if i not in slots.tolist() + ck_slots.tolist()]
    assert torch.equal(pool[others], before[others])
    for bad in (torch.tensor([7, 2, 9, 0, 7]), torch.tensor([7, 2, 9, 0, 13])):
        copy = pool.clone()
        with pytest.raises(RuntimeError, match="slots"):
            conv_in_place(x, weight, bias, "silu", copy, bad, fresh, cu, at, ck_slots)
        assert torch.equal(copy, pool)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_kernels_read_a_column_range_in_place(dtype):
    """Prefill and decode conv kernels given x as a column range of a wider tensor (rows
    further apart than the range is wide: a projection's q/k/v columns) give, bit for bit,
    what they give on its contiguous copy."""
    gen = torch.Generator().manual_seed(6)
    D, W = 24, 4
    wide = torch.randn(46, D + 13, generator=gen).to(dtype)
    x = wide[:, 5:5 + D]
    assert not x.is_contiguous()
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    state, cu, at = torch.randn(2, D, W - 1, generator=gen), torch.tensor([0, 40, 46]), torch.tensor([[0, 2], [1, 6]])
    got, want = (native.causal_conv1d(t, weight, bias, state, cu, at, True) for t in (x, x.contiguous()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    slots, states = torch.tensor([3, 0]), torch.randn(4, D, W - 1, generator=gen)
    after = [states.clone(), states.clone()]
    got, want = (native.conv_step(t, weight, bias, s, slots, True) for t, s in zip((x[:2], x[:2].contiguous()), after))
    assert torch.equal(got, want) and torch.equal(after[0], after[1])


@needs_kernel
@pytest.mark.parametrize("kv_heads,dk,dv", [(2, 64, 64), (1, 160, 128)], ids=["gqa", "mla"])
def test_prefill_over_shared_pages_equals_private_copies(kv_heads, dk, dv):
    """Sequences whose page tables share prefix pages (bf16 packed once for all of them on CPUs
    with AMX or AVX-512 BF16; elsewhere run for the whole batch at once where every sequence has
    them cached) get what they get when each reads its own copy of those pages: bit for bit where
    packed, within fp32 rounding (another order of the same sums) elsewhere; with key counts that
    end inside, at and past the shared pages, and MLA's values read from the keys."""
    gen = torch.Generator().manual_seed(8)
    ps, shared, lens, new = 16, 10, [150, 160, 200, 300], [6, 20, 64, 1]  # 128-key blocks: the first shared
    own = [(n - 1) // ps + 1 - shared for n in lens]  # pages past the shared ones
    k = torch.randn(shared + sum(own), ps, kv_heads, dk, generator=gen).bfloat16()
    v = k if dv < dk else torch.randn(k.shape[:3] + (dv,), generator=gen).bfloat16()
    starts = torch.tensor([0, *own]).cumsum(0)[:-1] + shared
    table = [list(range(shared)) + list(range(s, s + o)) for s, o in zip(starts.tolist(), own)]
    copies = [[i * 100 + p for p in range(len(t))] for i, t in enumerate(table)]  # each its own pages
    k2 = torch.zeros(400, ps, kv_heads, dk).bfloat16()
    v2 = k2 if v is k else torch.zeros(400, ps, kv_heads, dv).bfloat16()
    for t, c in zip(table, copies):
        k2[c] = k[t]
        if v is not k:
            v2[c] = v[t]
    width = max(len(t) for t in table)
    pad = lambda rows: torch.tensor([r + [-1] * (width - len(r)) for r in rows])  # noqa: E731
    q = torch.randn(sum(new), 4, dk, generator=gen).bfloat16()
    cu, seq_lens = torch.tensor([0, *new]).cumsum(0), torch.tensor(lens)
    got = native.paged_prefill(q, k, v, pad(table), cu, seq_lens, dk**-0.5, dv)
    want = native.paged_prefill(q, k2, v2, pad(copies), cu, seq_lens, dk**-0.5, dv)
    if native.extension().paged_prefill_packed(dk, dv):  # blocks packed once (AMX or AVX-512 BF16)
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dk,dv,latent", [(64, 64, False), (160, 128, True)], ids=["gqa", "mla"])
def test_prefill_query_outputs_do_not_depend_on_their_block(dk, dv, latent):
    """A query's prefill output is the same bits whichever query block holds it: the sequence's
    queries all in one call, or only those from position c on over the c keys before them cached
    (a prefix-cache hit), c inside, at and past 64-query blocks and 128-key blocks. Where the
    bf16 blocks are packed, each 32-row piece's score and value products run only over the keys
    its rows see, a count that moves with the blocks; within fp32 rounding where not packed."""
    gen = torch.Generator().manual_seed(9)
    ps, L = 16, 300
    k = torch.randn(L // ps + 1, ps, 2 if not latent else 1, dk, generator=gen).bfloat16()
    v = k if latent else torch.randn(k.shape[:3] + (dv,), generator=gen).bfloat16()
    table = torch.randperm(k.shape[0], generator=gen)[None]
    q = torch.randn(L, 4, dk, generator=gen).bfloat16()
    whole = native.paged_prefill(q, k, v, table, torch.tensor([0, L]), torch.tensor([L]), dk**-0.5, dv)
    for c in (1, 37, 64, 100, 128, 130, 250, 299):
        part = native.paged_prefill(q[c:], k, v, table, torch.tensor([0, L - c]), torch.tensor([L]), dk**-0.5, dv)
        if native.extension().paged_prefill_packed(dk, dv):
            assert torch.equal(part, whole[c:]), c
        else:
            torch.testing.assert_close(part, whole[c:], rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_resumed_from_its_state_equals_the_whole_run(dtype, silu, with_bias):
    """A sequence's prefill conv resumed after c tokens from the conv state it had there gives
    the whole run's outputs from c on, bit for bit: the first W-1 tokens after the cut read the
    state and run the general loop, the same tokens in the whole run the whole-window one, and
    both add the taps in one order (a prefix-cache hit is exact only so)."""
    gen = torch.Generator().manual_seed(10)
    L, D, W = 70, 40, 4
    x = torch.randn(L, D + 6, generator=gen).to(dtype)[:, 3 : 3 + D]
    weight = torch.randn(D, W, generator=gen)
    bias = torch.randn(D, generator=gen) if with_bias else None
    state = torch.randn(1, D, W - 1, generator=gen)
    cuts = (1, 2, 3, 5, 64, 69)
    at = torch.tensor([[0, c] for c in cuts])
    y, states = native.causal_conv1d(x, weight, bias, state, torch.tensor([0, L]), at, silu)
    for i, c in enumerate(cuts):
        rest, _ = native.causal_conv1d(x[c:], weight, bias, states[1 + i : 2 + i].contiguous(),
                                       torch.tensor([0, L - c]), torch.empty(0, 2, dtype=torch.long), silu)
        assert torch.equal(rest, y[c:]), c


@needs_kernel
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_sigmoid_routing_equals_the_torch_router(renorm, top_k, monkeypatch):
    """The compiled one-group routing chooses the torch router's experts, in its order
    (by score + correction bias, the bias able to reorder them), with its weights to the bit."""
    from types import SimpleNamespace

    from models.layers.mlp import GroupedTopKRouter

    cfg = SimpleNamespace(num_local_experts=8, hidden_size=32, num_experts_per_tok=top_k, n_group=1, topk_group=1,
                          norm_topk_prob=renorm, routed_scaling_factor=2.5)
    router = GroupedTopKRouter(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
    x = torch.randn(50, 32, generator=gen).bfloat16()
    calls = []
    real = native.topk_scores
    monkeypatch.setattr(native, "topk_scores", lambda *a: calls.append(1) or real(*a))
    idx, w = router(x)
    monkeypatch.setattr(native, "topk_scores", lambda *a: None)
    want_idx, want_w = router(x)
    assert calls and torch.equal(idx, want_idx) and torch.equal(w, want_w)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 37, 256, 300])
def test_router_logits_are_fp32_sums_whatever_rows_share_the_call(dtype, d):
    """router_logits = x w^T in fp32: within fp32 rounding of the exact (fp64) products' sum, as
    close as torch's fp32 linear; each row's logits the same bits alone, in any batch and read from
    a column range of a wider tensor (tails of D and of the 4-row passes included)."""
    gen = torch.Generator().manual_seed(d)
    w = torch.randn(8, d, generator=gen).bfloat16().float()  # a bf16 checkpoint's router, kept fp32
    wide = torch.randn(13, d + 5, generator=gen).to(dtype)
    x = wide[:, 3 : 3 + d]  # rows d + 5 apart
    got = native.router_logits(x, w)
    exact = x.double() @ w.double().T
    bound = 4 * 2**-24 * (x.double().abs() @ w.double().abs().T) * math.ceil(math.log2(d))  # fp32 sum of d terms
    assert got.dtype == torch.float32 and got.shape == (13, 8)
    assert ((got.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(got, F.linear(x.float(), w), rtol=1e-5, atol=1e-5)
    for rows in ([0], [5], [12, 0, 7], list(range(4, 13))):
        assert torch.equal(native.router_logits(x[rows].contiguous(), w), got[rows])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "loops"])
def test_ssd_kernel_equals_torch_ssd(dtype, fast, monkeypatch):
    """The compiled Mamba2 SSD gives the torch chunk path's outputs, final and checkpoint states
    on a varlen batch (grouped B/C, D skip, chunk-aligned and end checkpoints, an empty and a
    one-token sequence), its matmuls through small_mm and torch's BLAS, or plain loops."""
    from kernels.mamba2 import chunk_ssd
    from tests.kernels.test_mamba2 import cu_of, make_inputs, random_state

    lengths = [70, 0, 1, 33, 64]
    x = make_inputs(sum(lengths), dtype=dtype)
    args = dict(initial_state=random_state(len(lengths)), output_final_state=True, cu_seqlens=cu_of(lengths),
                checkpoint_at=torch.tensor([32, 64, 70, 71, 104, 136, 168]), chunk_size=32)
    old = native.extension().matmul_fast(fast)
    try:
        compiled = chunk_ssd(*x, **args)
    finally:
        native.extension().matmul_fast(old)
    monkeypatch.setattr(native, "chunk_ssd", lambda *a: None)
    reference = chunk_ssd(*x, **args)
    for got, want in zip(compiled, reference):
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 2e-5 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernel
def test_ssd_kernel_causal_row_blocks_equal_torch_ssd(monkeypatch):
    """At NemotronH's chunk of 128 tokens the compiled SSD runs a chunk's causal products in blocks
    of 64 rows, each stopping at its last row's token: chunks of one block (1, 44 or 64 tokens),
    of a full and a partial second block (65, 70, 127) and of two full ones give the torch chunk
    path's outputs, final and checkpoint states."""
    from kernels.mamba2 import chunk_ssd
    from tests.kernels.test_mamba2 import cu_of, make_inputs, random_state

    lengths = [300, 70, 64, 65, 1, 127, 256]
    x = make_inputs(sum(lengths), H=4, G=1)
    args = dict(initial_state=random_state(len(lengths), H=4), output_final_state=True, cu_seqlens=cu_of(lengths),
                checkpoint_at=torch.tensor([128, 256, 300, 370, 499, 627, 755]), chunk_size=128)
    compiled = chunk_ssd(*x, **args)
    monkeypatch.setattr(native, "chunk_ssd", lambda *a: None)
    for got, want in zip(compiled, chunk_ssd(*x, **args)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("lengths", [[150], [70, 45], [70, 0, 33, 64, 9]])
@pytest.mark.parametrize("threads", [1, 2])
def test_ssd_kernel_head_blocks_equal_torch_ssd(lengths, threads, monkeypatch):
    """However the compiled SSD splits a group's heads into jobs (one sequence: a head per job;
    two: blocks of two heads and one; five: the whole group, three heads sharing C . B^T), every
    head gets the torch chunk path's outputs, final and checkpoint states."""
    from kernels.mamba2 import chunk_ssd
    from tests.kernels.test_mamba2 import cu_of, make_inputs, random_state

    x = make_inputs(sum(lengths), H=6, G=2)
    state = random_state(len(lengths), H=6)
    ends = torch.tensor(lengths).cumsum(0)
    args = dict(output_final_state=True, cu_seqlens=cu_of(lengths), checkpoint_at=ends[torch.tensor(lengths) > 0],
                chunk_size=32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compiled = chunk_ssd(*x, initial_state=state.clone(), **args)
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(native, "chunk_ssd", lambda *a: None)
    reference = chunk_ssd(*x, initial_state=state.clone(), **args)
    for got, want in zip(compiled, reference):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("lengths", [[150], [70, 0, 33, 64, 9]])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 6])
def test_ssd_kernel_gated_norm_gives_the_bits_of_the_norm_pass(lengths, threads, groups):
    """chunk_ssd with `gate` returns gated_group_norm of its plain output bit for bit, states and
    checkpoints unchanged, whether each job norms its own heads' rows (whole norm groups: five
    sequences at 2 or 6 groups, one sequence at 6) or a pass after the jobs norms them (a job's
    heads splitting a norm group); z a column range of a wider projection. A bf16 x with the gate,
    or a bf16 z, is declined (None)."""
    from tests.kernels.test_mamba2 import cu_of, make_inputs, random_state

    H, P = 6, 8
    x = make_inputs(sum(lengths), H=H, P=P, G=2)
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(sum(lengths), H * P + 7, generator=gen)[:, 5 : 5 + H * P]
    w = torch.randn(H * P, generator=gen)
    rows = torch.stack([torch.arange(len(lengths)), torch.tensor(lengths)], 1)[torch.tensor(lengths) > 0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = {}
        for gate in (None, (z, w, groups, 1e-5)):
            state = random_state(len(lengths), H=H, P=P)
            y, states = native.chunk_ssd(*x, state, cu_of(lengths), rows, 32, gate=gate)
            runs[gate is None] = (y, state, states)
    finally:
        torch.set_num_threads(before)
    plain, normed = runs[True], runs[False]
    want = native.gated_group_norm(plain[0].reshape(len(z), -1), z, w, groups, 1e-5)
    assert torch.equal(normed[0].reshape(len(z), -1), want) and not torch.equal(want, plain[0].reshape(len(z), -1))
    assert torch.equal(normed[1], plain[1]) and torch.equal(normed[2], plain[2])
    bf16 = make_inputs(sum(lengths), H=H, P=P, G=2, dtype=torch.bfloat16)
    state = random_state(len(lengths), H=H, P=P)
    assert native.chunk_ssd(*bf16, state, cu_of(lengths), rows, 32, gate=(z, w, groups, 1e-5)) is None
    assert native.chunk_ssd(*x, state, cu_of(lengths), rows, 32, gate=(z.bfloat16(), w, groups, 1e-5)) is None


@needs_kernel
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_step_updates_slots_in_place(dtype, state_dtype, activation):
    """The compiled conv decode step equals the torch step (causal_conv1d_update) on the states
    of the named slots, writes the shifted windows in place, and leaves every other slot as
    it was."""
    from kernels.conv1d import causal_conv1d_update

    gen = torch.Generator().manual_seed(4)
    n, D, W = 5, 24, 4
    x = torch.randn(n, D, generator=gen).to(dtype)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    state = torch.randn(9, D, W - 1, generator=gen).to(state_dtype)
    slots = torch.tensor([8, 2, 0, 5, 3])
    for b in (bias, None):
        want_y, want_s = causal_conv1d_update(x, weight, b, state[slots], activation=activation)
        after = state.clone()
        y = native.conv_step(x, weight, b, after, slots, activation == "silu")
        assert y.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.float(), want_y.float(), rtol=tol, atol=tol)
        assert torch.equal(after[slots], want_s)  # the window shifted by one token, exactly
        others = [i for i in range(9) if i not in slots.tolist()]
        assert torch.equal(after[others], state[others])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_routing_equals_torch_bitwise(dtype, top_k, threads, monkeypatch):
    """The compiled dispatch (rows into padded expert blocks) and combine (weighted sum over
    the choices) give the torch routing's tensors bit for bit, for random routing with
    unequal expert loads and an expert nobody chose, on one thread or split over two (37 rows:
    three blocks of parallel_for's 16; fp32 sums once took fused multiply-adds on two)."""
    from models.layers import mlp

    gen = torch.Generator().manual_seed(5)
    t, d, e = 37, 24, 6
    x = torch.randn(t, d, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(e - 1, generator=gen)[:top_k] for _ in range(t)])  # expert 5 unused
    counts = torch.bincount(idx.flatten(), minlength=e)
    cap = int(counts.max()) + 1  # a spare padding row as well
    weight = torch.rand(t, top_k, generator=gen).to(dtype)
    y = torch.randn(e * cap, d, generator=gen).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        padded, at = mlp._dispatch(x, idx, counts, cap)
        out = mlp._combine(y, at, weight)
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(native, "moe_dispatch", lambda *a: None)
    monkeypatch.setattr(native, "moe_combine", lambda *a: None)
    want_padded, want_at = mlp._dispatch(x, idx, counts, cap)
    assert torch.equal(padded, want_padded) and torch.equal(at, want_at)
    assert torch.equal(out, mlp._combine(y, at, weight))
    assert torch.equal(padded.view(e * cap, d)[at], x.repeat_interleave(top_k, 0))  # each row where `at` says


@needs_kernel
@pytest.mark.parametrize("with_d", [True, False])
def test_ssd_step_updates_slots_in_place(with_d):
    """The compiled Mamba2 decode step equals the torch step (kernels/mamba2/recurrent.py) on
    the states of the named slots, with grouped B/C heads, writes them in place, and leaves
    every other slot as it was."""
    from kernels.mamba2.recurrent import recurrent_ssd

    gen = torch.Generator().manual_seed(6)
    n, h, p, g, s = 5, 4, 8, 2, 16
    x = torch.randn(n, h, p, generator=gen)
    dt = torch.rand(n, h, generator=gen)
    a = -torch.rand(h, generator=gen) * 4
    b, c = torch.randn(n, g, s, generator=gen), torch.randn(n, g, s, generator=gen)
    d = torch.randn(h, generator=gen) if with_d else None
    state = torch.randn(8, h, p, s, generator=gen)
    slots = torch.tensor([6, 1, 3, 0, 7])
    want_y, want_s = recurrent_ssd(x, dt, a, b, c, d, initial_state=state[slots], output_final_state=True,
                                   cu_seqlens=torch.arange(n + 1))
    after = state.clone()
    y = native.ssd_step(x, dt, a, b, c, d, after, slots)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[slots], want_s, rtol=1e-5, atol=1e-5)
    others = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(after[others], state[others])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["offset", "plain", "gated-silu", "gated-sigmoid"])
def test_rms_norm_equals_torch_norm(dtype, form, monkeypatch):
    """The compiled norms give models/layers/norm.py's torch formulation: (1 + w) and plain
    RMSNorm (cast before the weight, as the reference models round) and the gated output norm
    with an fp32 input and a gate in the model dtype, over [T, H, D] inputs."""
    from models.layers.norm import GatedRMSNorm, RMSNorm

    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 3, 40, generator=gen) * 3).to(dtype)
    if form.startswith("gated"):
        norm = GatedRMSNorm(40, eps=1e-6, activation=form.split("-")[1])
        x = x.float()
        args = (x, torch.randn(9, 3, 40, generator=gen).to(dtype))
    else:
        norm = RMSNorm(40, 1e-6, offset=1.0 if form == "offset" else 0.0).to(dtype)
        args = (x,)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=gen))
        got = norm(*args)
        with monkeypatch.context() as m:
            m.setattr(native, "rms_norm", lambda *a, **k: None)
            want = norm(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 2e-6 if got.dtype == torch.float32 else 1e-2  # bf16 outputs: one rounding apart at most
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@needs_kernel
def test_rms_norm_in_bf16_and_of_strided_rows():
    """The gated norm of an fp32 input straight to bf16 gives the fp32 result cast, every bit (one
    rounding either way); the rows of a column range are normed in place, as their contiguous copy."""
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(70, 4, 64, generator=gen) * 3, torch.randn(64, generator=gen)
    gate = torch.randn(70, 4, 64, generator=gen).bfloat16()
    for act in ("sigmoid", "silu"):
        got = native.rms_norm(x, w, 1e-6, gate=gate, act=act, dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, native.rms_norm(x, w, 1e-6, gate=gate, act=act).bfloat16())
    wide = (torch.randn(70, 200, generator=gen) * 3).bfloat16()
    rows = wide[:, 30:94]
    assert rows.stride() == (200, 1)
    for kw in ({}, {"cast_first": True}, {"offset": 1.0}):
        assert torch.equal(native.rms_norm(rows, w, 1e-6, **kw), native.rms_norm(rows.contiguous(), w, 1e-6, **kw))


@needs_kernel
@pytest.mark.parametrize("shape", [(70, 4, 64), (70, 64)])
def test_rms_norm_reads_a_gate_of_projection_columns_in_place(shape, monkeypatch):
    """A gate that is a column range of a wider projection's output (GDN's z beside qkv) is read
    where it lies: the same bits as its contiguous copy, and no copy made."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(*shape, generator=gen) * 3, torch.randn(64, generator=gen)
    inner = x[0].numel()
    wide = torch.randn(70, inner + 96, generator=gen).bfloat16()
    gate = wide[:, 32:32 + inner].view(shape)
    assert not gate.is_contiguous()
    want = {act: native.rms_norm(x, w, 1e-6, gate=gate.contiguous(), act=act, dtype=torch.bfloat16)
            for act in ("sigmoid", "silu")}
    copies, real = [], torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: copies.append(t.shape) or real(t, *a, **k))
    for act in ("sigmoid", "silu"):
        assert torch.equal(native.rms_norm(x, w, 1e-6, gate=gate, act=act, dtype=torch.bfloat16), want[act])
    assert not copies


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 4])
def test_gated_group_norm_equals_torch_norm(dtype, groups, monkeypatch):
    """The compiled Mamba2 output norm gives models/nemotron_h.py's torch formulation: w * norm(x *
    silu(z)) per channel group, fp32 x (the SSD output), z a column range of a projection in the
    model dtype, the result in z's dtype."""
    from models.nemotron_h import GroupedGatedRMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = GroupedGatedRMSNorm(64, groups, 1e-5)
    x = torch.randn(11, 64, generator=gen) * 3
    proj = torch.randn(11, 64 + 40, generator=gen).to(dtype)
    z = proj[:, 40:]  # rows 104 apart, as `split` leaves them
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        got = norm(x, z)
        with monkeypatch.context() as m:
            m.setattr(native, "gated_group_norm", lambda *a, **k: None)
            want = norm(x, z)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = 2e-6 if dtype == torch.float32 else 1e-2  # bf16 outputs: one rounding apart at most
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_build_lock_clears_a_killed_builds_lock_file(tmp_path):
    """torch's lock file, left by a build that was killed, does not make the next build wait."""
    (tmp_path / "lock").touch()
    with native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_build_lock_waits_for_a_live_build_and_not_for_a_killed_one(tmp_path):
    """A second build waits while the first holder lives and gets in once it is killed."""
    import subprocess
    import sys
    import threading

    hold = ("import sys, time; from pathlib import Path; from kernels import native\n"
            "with native.build_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def second_build():
            with native.build_lock(tmp_path):
                entered.set()

        t = threading.Thread(target=second_build, daemon=True)
        t.start()
        assert not entered.wait(0.5)
        holder.kill()
        assert entered.wait(10)
    finally:
        holder.kill()
        holder.wait()


def test_build_name_follows_the_sources(tmp_path, monkeypatch):
    """A change to any source or header gives the module a new name (its own build folder)."""
    copies = []
    for p in native.SOURCES + native.HEADERS:
        q = tmp_path / p.relative_to(native.HERE)
        q.parent.mkdir(parents=True, exist_ok=True)
        q.write_bytes(p.read_bytes())
        copies.append(q)
    monkeypatch.setattr(native, "SOURCES", copies[: len(native.SOURCES)])
    monkeypatch.setattr(native, "HEADERS", copies[len(native.SOURCES):])
    before = native.build_name()
    copies[-1].write_text(copies[-1].read_text() + "\n// changed\n")
    assert native.build_name() != before and native.build_name().isidentifier()


def test_build_name_covers_every_header_the_sources_include():
    """Every header a source or header includes with quotes is among those the module's name
    hashes, so an edit to it alone rebuilds the module."""
    import re

    included = set()
    for p in native.SOURCES + native.HEADERS:
        for name in re.findall(r'^#include "([^"]+)"', p.read_text(), re.M):
            included.add((p.parent / name).resolve())
    assert included and included <= {h.resolve() for h in native.HEADERS}


def test_build_uses_the_ninja_package_before_another_ninja_on_path(tmp_path, monkeypatch):
    """Builds run the ninja package's binary even where another ninja comes first on PATH
    (a venv not activated): two ninja versions reject each other's build log and rebuild
    every kernel whenever they alternate."""
    import os
    import shutil

    ninja = pytest.importorskip("ninja")
    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.0.0\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    assert shutil.which("ninja") == str(other)
    native.use_ninja_package()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    path = os.environ["PATH"]
    native.use_ninja_package()
    assert os.environ["PATH"] == path  # once first, left as it is


@needs_kernel
def test_kernels_let_other_python_threads_run():
    """A compiled kernel releases the GIL while it runs: a Python thread beside it (the server's
    event loop, streaming outputs) keeps running instead of waiting for the whole call."""
    import threading
    import time

    x, w = torch.ones(2_000_000, 64), torch.ones(64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the counting thread on the other
    try:
        t0 = time.perf_counter()
        native.rms_norm(x, w, 1e-6)
        call_s = time.perf_counter() - t0
        done, gaps = threading.Event(), []

        def count():
            last = time.perf_counter()
            while not done.is_set():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        counter = threading.Thread(target=count)
        counter.start()
        for _ in range(3):
            native.rms_norm(x, w, 1e-6)
        done.set()
        counter.join()
    finally:
        torch.set_num_threads(threads)
    assert call_s > 0.02  # long enough that a held GIL would show
    assert max(gaps) < call_s / 2, (max(gaps), call_s)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_residual_add_and_norm_in_one_pass_equal_the_two_ops(dtype, offset):
    """RMSNorm.add: the residual sum rounded as torch's add rounds it and the norm of that sum,
    the same bits as the add and the norm run apart; no residual: the norm of x alone."""
    from models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-6, offset=offset).to(dtype if not offset else torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
        x, residual = (torch.randn(7, 48, generator=gen).to(dtype) for _ in range(2))
        y, s = norm.add(x, residual)
        assert torch.equal(s, x + residual) and torch.equal(y, norm(x + residual))
        y0, s0 = norm.add(x, None)
        assert s0 is x and torch.equal(y0, norm(x))


def test_f32_copy_of_a_parameter_is_made_once_and_follows_writes():
    """A bf16 parameter's fp32 copy (norm and conv weights in a bf16 model) is made once, not at
    every call, and made anew when the parameter is written in place; activations are not kept."""
    p = torch.nn.Parameter(torch.randn(64).bfloat16(), requires_grad=False)
    first = native._f32(p)
    assert first.dtype == torch.float32 and torch.equal(first, p.float())
    assert native._f32(p) is first
    with torch.no_grad():
        p.mul_(2)
    again = native._f32(p)
    assert again is not first and torch.equal(again, p.float())
    x = torch.randn(64).bfloat16()
    assert native._f32(x) is not native._f32(x)


def test_f32_copy_of_a_parameters_view_is_kept_per_view():
    """A view of a bf16 parameter made anew by each forward (a conv weight's [:, 0]) gets one fp32
    copy per view, kept across calls, made anew when the parameter is written in place."""
    w = torch.nn.Parameter(torch.randn(16, 1, 4).bfloat16(), requires_grad=False)
    first = native._f32(w[:, 0])
    assert torch.equal(first, w[:, 0].float()) and first.is_contiguous()
    assert native._f32(w[:, 0]) is first  # a new view object, the same view
    rows = native._f32(w[4:, 0])
    assert rows is not first and torch.equal(rows, w[4:, 0].float())
    with torch.no_grad():
        w.add_(1)
    again = native._f32(w[:, 0])
    assert again is not first and torch.equal(again, w[:, 0].float())


@needs_kernel
def test_sigmoid_gate_is_torchs_bf16_ops_bit_for_bit():
    """o * sigmoid(gate) in one pass gives torch's bf16 ops' bits for every bf16 gate value (all
    65,536 bit patterns, NaNs aside; where the sigmoid is subnormal, zero or torch's bits: torch's
    own AVX2 and AVX-512 paths differ there) against random outputs, with the gate read in place from a
    column range; fp32 within fp32 rounding; mixed dtypes are refused and leave the torch path."""
    gen = torch.Generator().manual_seed(12)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[~bits.float().isnan()]
    g = torch.cat([values, values.new_zeros(-values.numel() % 64)]).reshape(-1, 64)  # every value, rows of 64
    wide = torch.randn(g.shape[0], 200, generator=gen).bfloat16()
    wide[:, 100:164] = g
    gate = wide[:, 100:164]
    o = torch.randn(g.shape, generator=gen).bfloat16()
    got, want = native.sigmoid_gate(o, gate), o * torch.sigmoid(gate)
    tiny = torch.sigmoid(gate).float() < torch.finfo(torch.float32).tiny  # a subnormal sigmoid (gates < -87.3)
    assert torch.equal(got[~tiny], want[~tiny])
    assert torch.all((got[tiny] == want[tiny]) | (got[tiny] == 0))  # or flushed to zero
    o32, g32 = torch.randn(50, 96, generator=gen), torch.randn(50, 96, generator=gen) * 8
    torch.testing.assert_close(native.sigmoid_gate(o32, g32), o32 * torch.sigmoid(g32), rtol=2e-6, atol=1e-7)
    assert native.sigmoid_gate(o32, g32.bfloat16()) is None
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        native.extension().sigmoid_gate(o32, g32.bfloat16())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_sigmoid_past_exps_range_are_torchs_zeros_not_nan(dtype):
    """Pre-activations below -88.72 (where exp(-x) overflows fp32) give what torch gives, 0 or a
    tiny finite value, in every compiled kernel with a silu or sigmoid: the gated norms, the conv
    prefill and step, Mamba2's gated group norm, the delta rule's beta, the experts, the attention
    gate. Built with -ffast-math, 1 / (1 + inf) came out NaN there."""
    from models.layers import mlp
    from tests.kernels.test_gemm import experts_and_routing

    gen = torch.Generator().manual_seed(13)
    ramp = torch.linspace(-400.0, 100.0, 64)  # below, across and above exp's range
    x = torch.randn(3, 64, generator=gen).to(dtype)
    g = ramp.repeat(3, 1).to(dtype)
    w = torch.rand(64, generator=gen) + 0.5
    for act, f in (("silu", F.silu), ("sigmoid", torch.sigmoid)):
        got = native.rms_norm(x, w, 1e-6, gate=g, act=act, dtype=dtype)
        want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w * f(g.float())).to(dtype)
        assert not got.isnan().any(), act
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
    gated = native.sigmoid_gate(x, g)  # bf16: torch's bits; fp32: within its rounding
    torch.testing.assert_close(gated, x * torch.sigmoid(g), rtol=0 if dtype == torch.bfloat16 else 2e-6, atol=0)
    v = (x.float() * F.silu(g.float())).view(3, 2, 32)
    want = (w.view(2, 32) * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).view(3, 64).to(dtype)
    group = native.gated_group_norm(x, g, w, 2, 1e-6)
    assert not group.isnan().any()
    torch.testing.assert_close(group.float(), want.float(), rtol=1e-2, atol=1e-5)
    conv_w, zeros = torch.ones(64, 4) / 4, torch.zeros(1, 64, 3)
    y, _ = native.causal_conv1d(g, conv_w, None, zeros, torch.tensor([0, 3]), torch.empty(0, 2, dtype=torch.long), True)
    want = F.silu(torch.stack([g.float()[: i + 1].sum(0) / 4 for i in range(3)])).to(dtype)
    assert not y.isnan().any()
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-5)
    step = native.conv_step(g, conv_w, None, torch.zeros(3, 64, 3), torch.arange(3), True)
    assert not step.isnan().any()
    torch.testing.assert_close(step.float(), F.silu(g.float() / 4).to(dtype).float(), rtol=1e-2, atol=1e-5)
    b = ramp[:8].reshape(1, 1, 8).repeat(3, 1, 1).to(dtype)  # beta = sigmoid(b) of 8 value heads
    qkv = torch.randn(3, 2 * 2 * 16 + 8 * 16, generator=gen).to(dtype)
    beta = native.delta_prepare(qkv, 2, 16, 8, 16, torch.zeros(3, 1, 8, dtype=dtype), torch.zeros(8),
                                torch.zeros(8), b, 1e-6)[4]
    assert not beta.isnan().any()
    torch.testing.assert_close(beta, torch.sigmoid(b.float()).reshape(3, 8), rtol=1e-6, atol=0)
    experts, xe, idx, we = experts_and_routing(4)
    stack = mlp.stack_experts(experts.to(dtype))
    big = stack.gate_up.clone()
    big[:, : big.shape[1] // 2] = -1e4  # every gate far below exp's range: silu(gate) is 0
    out = native.moe(xe.to(dtype).abs() + 1, idx, we, big, stack.down, "silu")
    if native.moe_runs(xe.to(dtype)):  # not fp32 on a CPU without AVX-512: torch runs the experts there
        assert out is not None and torch.equal(out, torch.zeros_like(out))
    else:
        assert out is None


def _written_into(fn, shape, dtype):
    """fn(out) with out rows [2, 2 + shape[0]) of a larger tensor: (its result, whether the result
    is those rows, whether the rows around them are as they were)."""
    big = torch.full((shape[0] + 5, *shape[1:]), 7.0, dtype=dtype)
    y = fn(big[2 : 2 + shape[0]])
    around = torch.cat([big[:2], big[2 + shape[0] :]])
    return y, y.data_ptr() == big[2:].data_ptr(), bool((around == 7.0).all())


@needs_kernel
def test_prefill_kernels_write_into_a_rounds_rows():
    """The three prefill kernels of a mixed round (SSD, the delta rule, the conv) write their outputs
    into the rows of the round's output they are given, the same bits as an output of their own,
    nothing around those rows touched; SSD reads x, B and C as column ranges of the conv output in
    place, the same bits as contiguous copies. Rows of another dtype or shape are not written:
    the kernel makes its own output."""
    from kernels.conv1d.torch import conv_in_place
    from kernels.kda.chunk import chunk_in_place
    from kernels.mamba2.chunk import chunk_ssd_in_place
    from tests.kernels import fla_interpret, test_mamba2

    lengths, slots, fresh = [70, 1, 33], torch.tensor([4, 0, 2]), torch.tensor([True, False, False])
    T, cu = sum(lengths), torch.tensor([0, *lengths]).cumsum(0)
    # SSD: x [T, 4, 8], B and C [T, 2, 6] as column ranges of one [T, 56] conv output
    x, dt, A, B, C, D = test_mamba2.make_inputs(T)
    conv_out = torch.cat([x.flatten(1), B.flatten(1), C.flatten(1)], 1)
    xs, Bs, Cs = (t.unflatten(1, s) for t, s in zip(conv_out.split([32, 12, 12], 1), [(4, 8), (2, 6), (2, 6)]))
    assert not xs.is_contiguous() and not Bs.is_contiguous()
    pool = test_mamba2.random_state(6)
    want = chunk_ssd_in_place(x, dt, A, B, C, D, pool.clone(), slots, fresh, cu, chunk_size=32)
    got, inside, kept = _written_into(lambda out: chunk_ssd_in_place(xs, dt, A, Bs, Cs, D, pool.clone(), slots, fresh,
                                                                     cu, chunk_size=32, out=out), x.shape, x.dtype)
    assert inside and kept and torch.equal(got, want)
    assert torch.equal(chunk_ssd_in_place(xs, dt, A, Bs, Cs, D, pool.clone(), slots, fresh, cu, chunk_size=32), want)
    # the delta rule
    q, k, v, g, beta, h0, cu_d = fla_interpret.make_inputs(lengths, False, H=2, HV=4, K=32, V=16)
    states = torch.randn(6, *h0.shape[1:], generator=torch.Generator().manual_seed(3))
    want = chunk_in_place(q, k, v, g, beta, states.clone(), slots, fresh, cu_d)
    got, inside, kept = _written_into(lambda out: chunk_in_place(q, k, v, g, beta, states.clone(), slots, fresh, cu_d,
                                                                 out=out), v.shape, torch.float32)
    assert inside and kept and torch.equal(got, want)
    # the conv, bf16 input read as a column range
    xc = torch.randn(T, 32, generator=torch.Generator().manual_seed(4)).bfloat16()[:, 4:28]
    weight, bias = torch.randn(24, 4), torch.randn(24)
    conv_pool = torch.randn(6, 24, 3)
    want = conv_in_place(xc, weight, bias, "silu", conv_pool.clone(), slots, fresh, cu)
    got, inside, kept = _written_into(lambda out: conv_in_place(xc, weight, bias, "silu", conv_pool.clone(), slots,
                                                                fresh, cu, out=out), xc.shape, xc.dtype)
    assert inside and kept and torch.equal(got, want)
    for bad in (torch.float32, (T + 1, 24)):  # another dtype, another shape: the kernel's own output
        shape, dtype = (bad, xc.dtype) if isinstance(bad, tuple) else (xc.shape, bad)
        got, inside, kept = _written_into(lambda out: conv_in_place(xc, weight, bias, "silu", conv_pool.clone(), slots,
                                                                    fresh, cu, out=out), shape, dtype)
        assert not inside and kept and torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_equals_relu_then_square(dtype):
    """NemotronH's relu(x)^2 in one compiled pass: the bits of F.relu then square_ in x's dtype,
    zeros and negatives included; a strided x is read right."""
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[0, :5] = torch.tensor([0.0, -0.0, -1.0, 1e-20, 3e19])
    for t in (x, x[:, 7:250]):
        want = torch.nn.functional.relu(t).square_()
        got = native.relu2(t)
        assert got.dtype == dtype and torch.equal(got, want)
