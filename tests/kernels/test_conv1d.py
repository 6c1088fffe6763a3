"""Causal conv1d: torch path vs the naive loop, conv-state invariants, transformers, CUDA."""
from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch
from kernels.conv1d import causal_conv1d, causal_conv1d_update, naive_causal_conv1d
from kernels.conv1d.cuda import cuda_causal_conv1d, cuda_causal_conv1d_update
from tests.utils import import_torch_reference, rel_err

pytestmark = pytest.mark.usefixtures("prefill_impl")  # tests/kernels/conftest.py: compiled and torch

FP32_TOL = 1e-5
NEMOTRON_H = "transformers.models.nemotron_h.modeling_nemotron_h"


def make_conv(T, D=6, W=4, N=None, seed=0, device="cpu", dtype=torch.float32):
    """Random x [T, D], weight [D, W], bias [D] and, when N is given, conv states [N, D, W-1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    weight = torch.randn(D, W, generator=gen).to(device, dtype)
    bias = torch.randn(D, generator=gen).to(device, dtype)
    state = None if N is None else torch.randn(N, D, W - 1, generator=gen).to(device, dtype)
    return x, weight, bias, state


def cu_of(lengths, device="cpu"):
    """cu_seqlens [N+1] int64 of the given lengths."""
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device)


@pytest.mark.parametrize("width", [2, 3, 4, 5])
@pytest.mark.parametrize("activation", ["silu", None])
def test_torch_matches_naive_varlen(width, activation):
    """causal_conv1d == naive loop: varlen, initial states, checkpoints nearer than W-1 to a start."""
    lengths = [2, 0, 9, 1, 12]  # cu = [0, 2, 2, 11, 12, 24]
    x, weight, bias, state = make_conv(sum(lengths), W=width, N=len(lengths))
    cu = cu_of(lengths)
    ck = torch.tensor([1, 2, 3, 4, 11, 12, 24, 13, 20])
    ref = naive_causal_conv1d(x, weight, bias, state, cu, activation, ck)
    out = causal_conv1d(x, weight, bias, state, cu, activation, ck)
    for got, want in zip(out, ref):
        assert rel_err(got, want) < FP32_TOL


def test_matches_f_conv1d_one_sequence():
    """With zero state and no bias, y == F.conv1d with W-1 left zero padding, then silu."""
    x, weight, _, _ = make_conv(17, W=4)
    y, final = causal_conv1d(x, weight)
    want = F.silu(F.conv1d(x.T[None], weight[:, None, :], padding=3, groups=x.shape[1])[0, :, :17].T)
    assert rel_err(y, want) < FP32_TOL
    assert torch.equal(final[0], x[-3:].T)


def test_matches_transformers_causal_conv1d_torch_fallback():
    """causal_conv1d == transformers' torch causal_conv1d_fn on equal-length rows, state == last inputs."""
    ref_mod = import_torch_reference(NEMOTRON_H)
    N, L, D = 3, 10, 6
    x, weight, bias, _ = make_conv(N * L, D=D)
    y_ref = ref_mod.causal_conv1d_fn(x.reshape(N, L, D).transpose(1, 2), weight, bias, activation="silu")
    y, final = causal_conv1d(x, weight, bias, None, cu_of([L] * N), "silu")
    assert rel_err(y, y_ref.transpose(1, 2).reshape(N * L, D)) < FP32_TOL
    assert torch.equal(final, x.reshape(N, L, D)[:, -3:].transpose(1, 2))


def test_update_matches_transformers_causal_conv1d_update():
    """causal_conv1d_update == transformers' torch causal_conv1d_update (which shifts in place)."""
    ref_mod = import_torch_reference(NEMOTRON_H)
    x, weight, bias, state = make_conv(5, N=5)
    ref_state = state.clone()
    y_ref = ref_mod.causal_conv1d_update(x[:, :, None], ref_state, weight, bias, activation="silu")
    y, new_state = causal_conv1d_update(x, weight, bias, state, "silu")
    assert rel_err(y, y_ref[:, :, 0]) < FP32_TOL
    assert torch.equal(new_state, ref_state)


@pytest.mark.parametrize("cuts", [[1], [2, 3], [5, 6, 13]])
def test_split_equals_one_shot(cuts):
    """Prefill in rounds cut anywhere, passing the conv state on, == one-shot prefill."""
    T = 16
    x, weight, bias, state = make_conv(T, N=1)
    y_all, final_all = causal_conv1d(x, weight, bias, state)
    pieces = []
    for start, end in zip([0] + cuts, cuts + [T]):
        y, state = causal_conv1d(x[start:end], weight, bias, state)
        pieces.append(y)
    assert rel_err(torch.cat(pieces), y_all) < FP32_TOL
    assert torch.equal(state, final_all)


def test_varlen_equals_separate_runs():
    """A varlen batch == separate single-sequence runs (y and final states)."""
    lengths = [3, 0, 8, 1]
    x, weight, bias, state = make_conv(sum(lengths), N=len(lengths))
    cu = cu_of(lengths)
    y_all, final_all = causal_conv1d(x, weight, bias, state, cu)
    for n in range(len(lengths)):
        start, end = cu[n].item(), cu[n + 1].item()
        y, final = causal_conv1d(x[start:end], weight, bias, state[n : n + 1])
        assert rel_err(y, y_all[start:end]) < FP32_TOL
        assert torch.equal(final[0], final_all[n])


def test_checkpoint_states_equal_truncated_final():
    """The conv state at checkpoint p == the final state of a run that stops at p."""
    lengths = [2, 9]
    x, weight, bias, state = make_conv(sum(lengths), N=2)
    cu = cu_of(lengths)
    ck = torch.tensor([3, 1, 11, 2, 4, 7])
    _, _, states = causal_conv1d(x, weight, bias, state, cu, checkpoint_at=ck)
    for i, p in enumerate(ck.tolist()):
        n = 0 if p <= 2 else 1
        start = cu[n].item()
        _, final = causal_conv1d(x[start:p], weight, bias, state[n : n + 1])
        assert torch.equal(states[i], final[0])


def test_decode_steps_after_prefill_equal_longer_prefill():
    """Prefill then causal_conv1d_update steps (batched over sequences) == one longer prefill."""
    prompt, steps = [1, 5, 2], 4
    lengths = [p + steps for p in prompt]
    x, weight, bias, state = make_conv(sum(lengths), N=3)
    cu = cu_of(lengths)
    y_all, final_all = causal_conv1d(x, weight, bias, state, cu)
    rows = torch.cat([torch.arange(s, s + p) for s, p in zip(cu[:-1].tolist(), prompt)])
    _, conv_state = causal_conv1d(x[rows], weight, bias, state, cu_of(prompt))
    for i in range(steps):
        rows = cu[:-1] + torch.tensor(prompt) + i
        y, conv_state = causal_conv1d_update(x[rows], weight, bias, conv_state)
        assert rel_err(y, y_all[rows]) < FP32_TOL
    assert torch.equal(conv_state, final_all)


def test_conv_state_is_read_only_and_dtypes_kept():
    """Neither call writes conv_state; y keeps x's dtype and states keep conv_state's dtype."""
    x, weight, bias, state = make_conv(7, N=1, dtype=torch.bfloat16)
    state32 = state.float()
    kept = state32.clone()
    y, final, states = causal_conv1d(x, weight, bias, state32, checkpoint_at=torch.tensor([2]))
    y1, new = causal_conv1d_update(x[:1], weight, bias, state32)
    assert torch.equal(state32, kept)
    assert (y.dtype, y1.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (final.dtype, states.dtype, new.dtype) == (torch.float32,) * 3


def test_bad_arguments_are_named():
    """Bad activation, weight, conv_state or checkpoint_at raise ValueError naming the argument."""
    x, weight, bias, state = make_conv(6, N=1)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, bias, state, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:3], bias, state)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, bias, state[:, :, :2])
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:2], weight, bias, state)
    with pytest.raises(ValueError, match="checkpoint_at"):
        causal_conv1d(x, weight, bias, state, checkpoint_at=torch.tensor([0]))


# --- CUDA wrappers: their glue, on CPU, against stand-ins with the causal-conv1d conventions ---


def fake_causal_conv1d(monkeypatch):
    """Install a CPU `causal_conv1d` that checks the real kernels' layout and dtype rules."""
    ref_mod = import_torch_reference(NEMOTRON_H)

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None, **unused):
        dim = x.shape[1]
        assert x.stride(2) == 1 or (x.stride(1) == 1 and dim % 8 == 0)
        assert bias is None or bias.dtype == weight.dtype
        return ref_mod.causal_conv1d_fn(x, weight, bias, activation=activation)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
        assert x.dim() == 2 and conv_state.dtype == x.dtype
        return ref_mod.causal_conv1d_update(x[:, :, None], conv_state, weight, bias, activation)[:, :, 0]

    module = ModuleType("causal_conv1d")
    module.causal_conv1d_fn, module.causal_conv1d_update = causal_conv1d_fn, causal_conv1d_update
    monkeypatch.setitem(sys.modules, "causal_conv1d", module)


@pytest.mark.parametrize("dim", [6, 16])
def test_cuda_glue_matches_torch_on_cpu(monkeypatch, dim):
    """cuda_causal_conv1d's extended layout == causal_conv1d (stand-in kernel, both layouts)."""
    fake_causal_conv1d(monkeypatch)
    lengths = [2, 0, 9, 5]
    x, weight, bias, state = make_conv(sum(lengths), D=dim, N=len(lengths))
    cu = cu_of(lengths)
    ck = torch.tensor([1, 3, 11, 16])
    for got, want in zip(cuda_causal_conv1d(x, weight, bias, state, cu, "silu", ck),
                         causal_conv1d(x, weight, bias, state, cu, "silu", ck)):
        assert rel_err(got, want) < FP32_TOL


def test_cuda_update_glue_matches_torch_on_cpu(monkeypatch):
    """cuda_causal_conv1d_update == causal_conv1d_update and leaves conv_state untouched."""
    fake_causal_conv1d(monkeypatch)
    x, weight, bias, state = make_conv(4, N=4)
    kept = state.clone()
    for got, want in zip(cuda_causal_conv1d_update(x, weight, bias, state),
                         causal_conv1d_update(x, weight, bias, state)):
        assert rel_err(got, want) < FP32_TOL
    assert torch.equal(state, kept)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 36])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_matches_torch_path(dim, dtype, tol):
    """causal-conv1d kernels == torch path on CUDA: varlen, initial states, checkpoints, decode."""
    pytest.importorskip("causal_conv1d")
    lengths = [2, 0, 300, 1, 77]
    x, weight, bias, state = make_conv(sum(lengths), D=dim, N=len(lengths), device="cuda", dtype=dtype)
    cu = cu_of(lengths, "cuda")
    ck = torch.tensor([1, 2, 5, 302, 303, 380], device="cuda")
    got = dispatch.get("conv1d_prefill", "cuda")(x, weight, bias, state, cu, "silu", ck)
    for g, w in zip(got, causal_conv1d(x, weight, bias, state, cu, "silu", ck)):
        assert rel_err(g, w) < tol
    step = dispatch.get("conv1d_decode", "cuda")(x[:5], weight, bias, state, "silu")
    for g, w in zip(step, causal_conv1d_update(x[:5], weight, bias, state, "silu")):
        assert rel_err(g, w) < tol
