"""The packed bf16 micro-kernels (kernels/gemm/cpu_gemm.cpp) give torch's bf16 results (oneDNN's
the same bits, our own AVX-512 BF16 or AVX2 ones within a bf16 step), and the compiled kernels
leave the denormal mode of torch's threads as they found it."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import native
from models.layers import mlp
from models.layers.linear import Linear, linear
from models.layers.mlp import GatedMLP, run_experts

needs_bf16_gemm = pytest.mark.skipif(native._bf16_gemm() is None, reason="no bf16 micro-kernels on this CPU")


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [0, 1, 5, 31, 33, 64, 65, 300, 1000])
@pytest.mark.parametrize("outs", [1, 8, 100, 256])
def test_linear_equals_torch_bit_for_bit(rows, outs):
    """Any row count (whole and partial row blocks; at 1,000 rows each thread takes whole row
    blocks), output widths that are and are not whole blocks of 32: every output is torch's bf16
    matmul's, every bit (fp32 sums rounded once)."""
    gen = torch.Generator().manual_seed(rows * 1000 + outs)
    w = torch.randn(outs, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    got = native.linear_bf16(x, w)
    assert got is not None and got.dtype == torch.bfloat16
    native.assert_torch_bf16_bits(got, F.linear(x, w))


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_linear_is_each_dot_product_rounded_once(rows):
    """Whichever micro-kernels run, every output is its exact dot product up to fp32 summation
    error, rounded once to bf16: within half a bf16 step of the fp64 product, plus the fp32 error."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    w = torch.randn(77, 256, generator=gen).bfloat16()
    got = native.linear_bf16(x, w).double()
    exact = x.double() @ w.double().T
    fp32_error = 256 * 2**-24 * (x.double().abs() @ w.double().abs().T)
    assert bool(((got - exact).abs() <= exact.abs() * 2**-8 + fp32_error).all())


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 64, 700])
@pytest.mark.parametrize("outs", [4, 9, 16, 17, 40])
def test_linear_outputs_do_not_depend_on_the_columns_beside_them(rows, outs):
    """A block with at most 16 outputs runs half the micro-kernel's columns (a router's few
    outputs): each output is the same bits as when its block is full of other outputs (the
    same weight rows first in a wider projection, as a fused projection holds them)."""
    gen = torch.Generator().manual_seed(rows + outs)
    wide = torch.randn(outs + 64, 96, generator=gen).bfloat16()
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    assert torch.equal(native.linear_bf16(x, wide[:outs]), native.linear_bf16(x, wide)[:, :outs])


@needs_bf16_gemm
@pytest.mark.parametrize("width", [96, 50])  # K a multiple of the micro-kernel's 32-wide steps, or not
def test_linear_rows_do_not_depend_on_the_batch(width):
    """A row's outputs are the same bits whatever rows share its call (one row alone, a partial
    block, several blocks, prefill sizes whose calls split by whole row blocks), so batched and
    single-request runs agree; within one bf16 step of torch's, whose oneDNN matmul sums a K that
    is not a multiple of 32 in another order."""
    gen = torch.Generator().manual_seed(width)
    w = torch.randn(100, width, generator=gen).bfloat16()
    x = torch.randn(1100, width, generator=gen).bfloat16()
    full = native.linear_bf16(x, w)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 40), slice(64, 130), slice(37, 1037)):
        assert torch.equal(native.linear_bf16(x[rows], w), full[rows])
    torch.testing.assert_close(full, F.linear(x, w), rtol=2**-7, atol=1e-6)


@needs_bf16_gemm
def test_linear_bias_strided_weight_and_batch_dims():
    """A bias is added in fp32 before the one rounding; a weight that is a row range of a larger
    stack (fused projections) and inputs with leading batch dims work as F.linear's do."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(80, 64, generator=gen).bfloat16()
    w, b = stack[16:56], torch.randn(40, generator=gen).bfloat16()
    x = torch.randn(3, 7, 64, generator=gen).bfloat16()
    got = linear(x, w, b)
    want = (F.linear(x.float(), w.float()) + b.float()).bfloat16()
    assert got.shape == (3, 7, 40)
    native.assert_torch_bf16_bits(got, want)
    native.assert_torch_bf16_bits(linear(x, w), F.linear(x, w))
    x = torch.randn(700, 64, generator=gen).bfloat16()  # prefill size: whole row blocks per thread
    got = linear(x, w, b)
    assert torch.equal(got, torch.cat([linear(x[i : i + 64], w, b) for i in range(0, 700, 64)]))
    torch.testing.assert_close(got, (F.linear(x.float(), w.float()) + b.float()).bfloat16(), rtol=2**-7, atol=1e-6)


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 64, 700])
def test_linear_reads_a_column_range_in_place(rows):
    """x a column range of a wider tensor (a fused projection's output) gives the bits of the
    same rows made contiguous, at decode and prefill sizes."""
    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 200, generator=gen).bfloat16()
    w = torch.randn(48, 64, generator=gen).bfloat16()
    x = wide[:, 100:164]
    assert x.stride() == (200, 1)
    assert torch.equal(native.linear_bf16(x, w), native.linear_bf16(x.contiguous(), w))
    native.assert_torch_bf16_bits(native.linear_bf16(x, w), F.linear(x.contiguous(), w))


@needs_bf16_gemm
@pytest.mark.parametrize("tokens", [0, 1, 64, 65, 700])
def test_heads_equal_torch_einsum_bit_for_bit(tokens):
    """The per-head products of MLA's absorbed projections (x [T, H, K] a strided view, w [H, N,
    K]) written into a column range of a wider tensor are torch's bf16 einsum's, every bit, at
    decode sizes (items per column block) and prefill sizes (row blocks whole); the rest of the
    tensor is untouched."""
    gen = torch.Generator().manual_seed(tokens)
    h, k, n = 4, 64, 128
    q = torch.randn(tokens, h, k + 32, generator=gen).bfloat16()[..., :k]  # rows and heads strided
    w = torch.randn(h, k + 64, n, generator=gen).bfloat16()
    w_uk = w[:, :k]  # [H, K, N]: the weight of head h is w_uk[h]^T
    out = torch.full((tokens, h, n + 32), 7.0).bfloat16()
    assert native.heads_bf16(q, w_uk.transpose(1, 2), out[..., :n], w, "test_heads")
    native.assert_torch_bf16_bits(out[..., :n], torch.einsum("thk,hkn->thn", q, w_uk))
    assert bool((out[..., n:] == 7).all())
    w_uv = w[:, k:]  # [H, 64, N]: a second view of the same parameter, its own pack
    o = torch.randn(tokens, h, n, generator=gen).bfloat16()
    got = torch.empty(tokens, h, 64).bfloat16()
    assert native.heads_bf16(o, w_uv, got, w, "test_heads_uv")
    native.assert_torch_bf16_bits(got, torch.einsum("thn,hvn->thv", o, w_uv))
    assert not native.heads_bf16(q.float(), w_uk.float().transpose(1, 2), out.float()[..., :n])  # fp32: torch's


needs_f32_gemm = pytest.mark.skipif(
    native.extension() is None or not native.extension().gemm_f32_supported(),
    reason="no fp32 micro-kernel on this CPU (AVX-512 BF16 without AMX, AVX2 without AVX-512)")


@needs_f32_gemm
@pytest.mark.parametrize("rows", [0, 1, 5, 33, 64, 65, 700])
@pytest.mark.parametrize("outs", [1, 40, 100])
def test_f32_linear_is_each_dot_product_summed_in_fp32(rows, outs):
    """The fp32 kernel: every output its exact dot product (plus bias) up to fp32 summation error,
    for whole and partial row and column blocks, with and without a bias, on a weight that is a
    row range of a larger stack and inputs with leading batch dims."""
    gen = torch.Generator().manual_seed(rows * 100 + outs)
    stack = torch.randn(outs + 20, 96, generator=gen)
    w, b = stack[10 : 10 + outs], torch.randn(outs, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    for bias in (None, b):
        got = linear(x.view(1, rows, 96), w, bias)
        assert got.shape == (1, rows, outs) and got.dtype == torch.float32
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        bound = 100 * 2**-24 * (x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs()))
        assert bool(((got[0].double() - exact).abs() <= bound + 1e-30).all())


@needs_f32_gemm
def test_f32_linear_rows_do_not_depend_on_the_batch_and_read_columns_in_place():
    """A row's fp32 outputs are the same bits whatever rows share its call (prefill sizes split
    by whole row blocks, decode sizes by column blocks), and a column range of a wider tensor is
    read in place with the bits of its contiguous copy."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(100, 64, generator=gen)
    wide = torch.randn(1100, 200, generator=gen)
    x = wide[:, 100:164]
    full = native.linear_f32(x, w)
    assert torch.equal(full, native.linear_f32(x.contiguous(), w))
    for rows in (slice(0, 1), slice(5, 6), slice(3, 40), slice(64, 130), slice(37, 1037)):
        assert torch.equal(native.linear_f32(x[rows], w), full[rows])


@needs_f32_gemm
def test_fp32_matmul_torch_turns_the_fp32_kernels_off_inside_only():
    """Inside fp32_matmul("torch") linear_f32 and the fp32 experts kernel give None (their callers
    take torch's matmul: a Linear equals F.linear bit for bit there); outside, and after an
    exception inside, the micro-kernel runs again; an unknown path is refused."""
    gen = torch.Generator().manual_seed(2)
    x, layer = torch.randn(70, 96, generator=gen), Linear(96, 40).requires_grad_(False)
    with native.fp32_matmul("torch"):
        assert native.linear_f32(x, layer.weight) is None and not native.moe_runs(x)
        assert not native.fp32_micro_kernel()
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert native.linear_f32(x, layer.weight) is not None and native.moe_runs(x) and native.fp32_micro_kernel()
    with pytest.raises(RuntimeError), native.fp32_matmul("torch"):
        raise RuntimeError
    assert native.linear_f32(x, layer.weight) is not None
    with pytest.raises(ValueError, match="ours"), native.fp32_matmul("mkl"):
        pass


def test_linear_falls_back_to_torch_where_the_kernels_do_not_run():
    """For the bf16 kernels fp32, odd input widths and autograd go to F.linear (None from the
    wrapper); for the fp32 one other dtypes and autograd."""
    x = torch.randn(4, 9)
    assert native.linear_bf16(x, torch.randn(3, 9)) is None
    assert native.linear_bf16(x.bfloat16(), torch.randn(3, 9).bfloat16()) is None
    w = torch.randn(3, 8, dtype=torch.bfloat16, requires_grad=True)
    assert native.linear_bf16(torch.randn(4, 8).bfloat16(), w) is None
    assert native.linear_f32(x.bfloat16(), torch.randn(3, 9).bfloat16()) is None  # not fp32
    assert native.linear_f32(torch.randn(4, 8), w.float().detach().requires_grad_()) is None  # autograd
    assert native.linear_f32(torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)) is None
    layer = Linear(9, 3)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16_gemm
def test_packed_weight_follows_changed_weights():
    """A weight changed in place (its version counter) or replaced by .to() is packed anew,
    never served from a stale pack."""
    layer = Linear(64, 32, bias=False).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        first = layer(x)
        layer.weight.mul_(2)
        native.assert_torch_bf16_bits(layer(x), F.linear(x, layer.weight))
        assert not torch.equal(layer(x), first)
        layer.to(torch.float32).to(torch.bfloat16)
        layer.weight.copy_(torch.ones_like(layer.weight))
        native.assert_torch_bf16_bits(layer(x), F.linear(x, layer.weight))


def experts_and_routing(tokens: int, seed: int = 0):
    torch.manual_seed(seed)
    experts = nn.ModuleList(GatedMLP(64, 48) for _ in range(6)).bfloat16()
    x = torch.randn(tokens, 64).bfloat16()
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])
    return experts, x, idx, torch.rand(tokens, 2).bfloat16()


@needs_bf16_gemm
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_moe_equals_the_torch_path(monkeypatch, tokens):
    """One compiled call per layer gives the padded torch path's result with its roundings:
    bit for bit except where the vector exp rounds a silu differently, one bf16 step there."""
    experts, x, idx, w = experts_and_routing(tokens)
    with torch.no_grad():
        got = run_experts(x, experts, idx, w)
        monkeypatch.setattr(mlp.native, "moe", lambda *a: None)
        want = run_experts(x, experts, idx, w)
    same = (got == want).float().mean().item()
    assert same > 0.99, same
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@needs_bf16_gemm
@pytest.mark.parametrize("tokens", [1, 40, 150])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_runs_a_shared_expert_in_the_same_call(monkeypatch, tokens, gated):
    """A shared expert (Qwen3-Next's sigmoid-gated one, Kimi Linear's ungated one; 40 channels, not
    whole blocks) runs in the experts' call: bit for bit the routed sum + scale * shared in torch's
    bf16 ops, the shared expert's output being the compiled call's own (as a one-expert layer);
    the torch path agrees within the vector exp's rounding of a silu."""
    experts, x, idx, w = experts_and_routing(tokens)
    torch.manual_seed(1)
    shared = GatedMLP(64, 40).bfloat16()
    scale = torch.sigmoid(torch.randn(tokens, 1)).bfloat16() if gated else None
    with torch.no_grad():
        got = run_experts(x, experts, idx, w, shared=shared, scale=scale)
        alone = run_experts(x, nn.ModuleList([shared]), torch.zeros(tokens, 1, dtype=torch.long),
                            torch.ones(tokens, 1, dtype=torch.bfloat16))
        assert torch.equal(got, run_experts(x, experts, idx, w) + (alone if scale is None else scale * alone))
        monkeypatch.setattr(mlp.native, "moe", lambda *a: None)
        want = run_experts(x, experts, idx, w, shared=shared, scale=scale)
        assert torch.equal(want, run_experts(x, experts, idx, w) + (shared(x) if scale is None else scale * shared(x)))
    assert (got == want).float().mean().item() > 0.99
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-6)


@needs_bf16_gemm
def test_moe_shared_rows_split_between_threads_change_no_bit():
    """At decode sizes (fewer than 64 tokens a thread) the shared expert's rows are split
    between the threads: 1, 2 or 3 threads give the same bits."""
    experts, x, idx, w = experts_and_routing(40)
    torch.manual_seed(1)
    shared = GatedMLP(64, 40).bfloat16()
    scale = torch.sigmoid(torch.randn(40, 1)).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        with torch.no_grad():
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                outs.append(run_experts(x, experts, idx, w, shared=shared, scale=scale))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_bf16_gemm
def test_moe_routes_every_choice_to_one_expert():
    """Skewed routing (every token on the same two experts, several row blocks each) and an
    expert no token chose."""
    experts, x, _, w = experts_and_routing(150)
    idx = torch.tensor([[3, 0]] * 150)
    with torch.no_grad():
        got = run_experts(x, experts, idx, w)
        want = torch.stack([w[t, 0].float() * experts[3](x[t : t + 1]).float()[0]
                            + w[t, 1].float() * experts[0](x[t : t + 1]).float()[0] for t in range(150)])
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_f32_gemm
@pytest.mark.parametrize("tokens", [1, 16, 200])
@pytest.mark.parametrize("shared", [None, "gated", "ungated"])
def test_f32_moe_is_the_torch_path_within_fp32_rounding(monkeypatch, tokens, shared):
    """fp32 experts (the built-in model's default dtype) run as one compiled call too: the routed
    sum, with a shared expert (40 channels: a partial block) times its gate or not, within fp32
    summation error of the torch path's batched matmuls; each token's output depends on its own
    row only (the same bits alone as in the batch)."""
    experts, x, idx, w = experts_and_routing(tokens)
    experts, x, w = experts.float(), x.float(), w.float()
    torch.manual_seed(1)
    extra = None if shared is None else GatedMLP(64, 40)
    scale = torch.sigmoid(torch.randn(tokens, 1)) if shared == "gated" else None
    calls = []
    real = mlp.native.moe
    monkeypatch.setattr(mlp.native, "moe", lambda *a: calls.append(a[0].dtype) or real(*a))
    with torch.no_grad():
        got = run_experts(x, experts, idx, w, shared=extra, scale=scale)
        last = run_experts(x[-1:], experts, idx[-1:], w[-1:], shared=extra, scale=None if scale is None else scale[-1:])
        monkeypatch.setattr(mlp.native, "moe", lambda *a: None)
        want = run_experts(x, experts, idx, w, shared=extra, scale=scale)
    assert calls == [torch.float32, torch.float32] and got.dtype == torch.float32
    assert torch.equal(last, got[-1:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gated", [True, False])
def test_moe_in_token_blocks_gives_the_bits_of_expert_items(monkeypatch, dtype, gated):
    """From 256 tokens a thread the experts call runs blocks of 128 tokens whole (routed rows,
    shared expert, combine) rather than (expert, rows) items over the batch: each token's output
    is the same bits as in a batch small enough for the items (a partial last block, skewed
    experts)."""
    if native._experts_kernel(dtype)[0] is None:
        pytest.skip(f"no compiled experts for {dtype} on this CPU")
    tokens = 256 * torch.get_num_threads() + 77
    experts, x, idx, w = experts_and_routing(tokens)
    idx[: tokens // 3] = torch.tensor([4, 1])  # two experts with several row blocks in a token block
    torch.manual_seed(1)
    shared = GatedMLP(64, 40).to(dtype)
    experts, x, w = experts.to(dtype), x.to(dtype), w.to(dtype)
    scale = torch.sigmoid(torch.randn(tokens, 1)).to(dtype) if gated else None
    calls = []
    real = mlp.native.moe
    monkeypatch.setattr(mlp.native, "moe", lambda *a: calls.append(len(a[0])) or real(*a))
    with torch.no_grad():
        whole = run_experts(x, experts, idx, w, shared=shared, scale=scale)
        parts = [run_experts(x[i : i + 100], experts, idx[i : i + 100], w[i : i + 100], shared=shared,
                             scale=None if scale is None else scale[i : i + 100]) for i in range(0, tokens, 100)]
    assert calls[0] == tokens and len(calls) == 1 + len(parts)  # the compiled call ran every time
    assert torch.equal(whole, torch.cat(parts))


def test_f32_moe_refuses_what_it_cannot_run():
    """Mixed dtypes, another activation and a scale without a shared expert go to the torch path
    (None) or are refused by the kernel with a clear error."""
    experts, x, idx, w = experts_and_routing(8)
    stack = mlp.stack_experts(experts.float())
    xf = x.float()
    assert native.moe(xf, idx, w, stack.gate_up.bfloat16(), stack.down, "silu") is None  # mixed dtypes
    assert native.moe(xf, idx, w, stack.gate_up, stack.down, "gelu") is None
    ext = native.extension()
    if ext is not None and ext.gemm_f32_supported():
        gu, dn = ext.pack_experts_f32(stack.gate_up, stack.down)
        with pytest.raises(RuntimeError, match="scale"):
            ext.moe_f32(xf, idx, w.float(), gu, dn, "silu", native.EMPTY, native.EMPTY, torch.ones(8))
        with pytest.raises(RuntimeError, match="expert id out of range"):
            ext.moe_f32(xf, idx + 6, w.float(), gu, dn, "silu", native.EMPTY, native.EMPTY, native.EMPTY)


@pytest.mark.skipif(native.extension() is None, reason="CPU kernels not built here")
def test_kernels_leave_the_denormal_mode_of_torch_threads():
    """The kernels flush denormals only while they run: afterwards torch's ops on the calling
    thread and on its worker threads still produce denormals."""
    from kernels.attention.torch import decode
    from tests.kernels.test_attention import make_batch

    b = make_batch([3, 40, 9], [1, 1, 1], (4, 2), 16)
    decode(b.q, b.k_cache, b.v_cache, b.page_table, torch.tensor([3, 40, 9]), 0.25, 16)
    tiny = torch.full((1 << 20,), 1e-39)  # big enough for torch to split it over its threads
    assert bool(((tiny * 1.0) == 1e-39).all())
    assert float(torch.tensor(1e-39) * 1.0) != 0.0


def qwen3_next_moe(dtype: torch.dtype, renorm: bool):
    from types import SimpleNamespace

    from models.qwen3_next import SparseMoE

    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=64, hidden_act="silu", num_experts_per_tok=2, norm_topk_prob=renorm,
                          num_experts=6, moe_intermediate_size=48, shared_expert_intermediate_size=40)
    return SparseMoE(cfg).to(dtype)


def test_sparse_moe_takes_its_steps_where_the_call_cannot_run(monkeypatch):
    """With autograd on the input, or the fused projections off for a comparison, the layer runs
    its steps (and the one-call wrapper refuses what it cannot run)."""
    layer = qwen3_next_moe(torch.float32, True)
    monkeypatch.setattr(native, "softmax_moe", lambda *a: pytest.fail("the one-call path ran"))
    x = torch.randn(5, 64, requires_grad=True)
    layer(x).sum().backward()
    from models.layers import linear as linear_layer
    monkeypatch.setattr(linear_layer, "ENABLED", False)
    with torch.no_grad():
        layer(x.detach())


def kimi_moe(dtype: torch.dtype, renorm: bool):
    from types import SimpleNamespace

    from models.kimi_linear import KimiMoE

    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=64, num_local_experts=6, moe_intermediate_size=48, n_shared_experts=1,
                          num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=renorm,
                          routed_scaling_factor=2.446)
    layer = KimiMoE(cfg)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.1)
        layer.gate.e_score_correction_bias.normal_(0, 0.1)
    return layer.to(dtype)


ONE_CALL_MOE = {"qwen3-next": (qwen3_next_moe, "softmax_moe"), "kimi": (kimi_moe, "scores_moe")}


@pytest.mark.parametrize("model", list(ONE_CALL_MOE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("tokens", [1, 40, 300])
def test_moe_layer_in_one_call_is_its_steps_bit_for_bit(monkeypatch, model, dtype, renorm, tokens):
    """Qwen3-Next's MoE layer (router and shared gate, softmax top-k, the gate's sigmoid, experts) and
    Kimi Linear's (router logits, sigmoid, biased top-k, experts with the shared one) as one compiled
    call each give the bits of the same kernels called one by one from Python."""
    if native._experts_kernel(dtype)[0] is None:
        pytest.skip(f"no compiled experts for {dtype} on this CPU")
    make, name = ONE_CALL_MOE[model]
    layer = make(dtype, renorm)
    x = torch.randn(tokens, 64).to(dtype)
    calls = []
    real = getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = layer(x)
        assert calls  # the one-call path ran
        monkeypatch.setattr(native, name, lambda *a: None)
        want = layer(x)
    assert torch.equal(got, want)
