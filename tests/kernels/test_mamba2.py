"""Mamba2 SSD: chunk and decode paths vs the naive loop, state invariants, transformers, CUDA."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from kernels import dispatch
from kernels.mamba2 import chunk_ssd, naive_ssd, recurrent_ssd
from kernels.mamba2.chunk import segsum
from kernels.mamba2.cuda import cuda_chunk_ssd, cuda_recurrent_ssd
from tests.utils import import_torch_reference, rel_err

pytestmark = pytest.mark.usefixtures("prefill_impl")  # tests/kernels/conftest.py: compiled and torch

FP32_TOL = 1e-5
NEMOTRON_H = "transformers.models.nemotron_h.modeling_nemotron_h"


class Inputs(NamedTuple):
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H]
    A: torch.Tensor  # [H]
    B: torch.Tensor  # [T, G, S]
    C: torch.Tensor  # [T, G, S]
    D: torch.Tensor  # [H]

    def args(self):
        return (self.x, self.dt, self.A, self.B, self.C, self.D)

    def rows(self, start, end):
        """The tokens start .. end-1 (A and D unchanged)."""
        s = slice(start, end)
        return Inputs(self.x[s], self.dt[s], self.A, self.B[s], self.C[s], self.D)


def make_inputs(T, H=4, P=8, G=2, S=6, seed=0, device="cpu", dtype=torch.float32):
    """Random SSD inputs with dt in (0.05, 0.55) (post-softplus) and A in (-2.1, -0.1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen)
    dt = torch.rand(T, H, generator=gen) * 0.5 + 0.05
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B, C = torch.randn(T, G, S, generator=gen), torch.randn(T, G, S, generator=gen)
    D = torch.randn(H, generator=gen)
    low = lambda t: t.to(device, dtype)  # noqa: E731  x, B, C in the model's dtype; dt, A, D fp32
    return Inputs(low(x), dt.to(device), A.to(device), low(B), low(C), D.to(device))


def random_state(N, H=4, P=8, S=6, seed=1, device="cpu"):
    """Random fp32 states [N, H, P, S]."""
    return torch.randn(N, H, P, S, generator=torch.Generator().manual_seed(seed)).to(device)


def cu_of(lengths, device="cpu"):
    """cu_seqlens [N+1] int64 of the given lengths."""
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device)


@pytest.mark.parametrize("chunk_size", [4, 8, 16])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunk_matches_naive_varlen(chunk_size, groups):
    """chunk_ssd == naive_ssd (y, final and checkpoint states) on varlen input with initial states."""
    lengths = [5, 0, 16, 11, 1]  # cu = [0, 5, 5, 21, 32, 33]
    inp = make_inputs(sum(lengths), G=groups)
    cu = cu_of(lengths)
    h0 = random_state(len(lengths))
    aligned = [21 + k for k in (4, 8) if k % chunk_size == 0]
    ck = torch.tensor([5 + chunk_size, 33, 5, 21, 32] + aligned)
    ref = naive_ssd(*inp.args(), h0, True, cu, ck)
    out = chunk_ssd(*inp.args(), h0, True, cu, ck, chunk_size=chunk_size)
    for got, want in zip(out, ref):
        assert rel_err(got, want) < FP32_TOL


def test_chunk_matches_naive_one_sequence_defaults():
    """With cu_seqlens, initial_state and D left out, chunk_ssd == naive_ssd, and final_state is None."""
    inp = make_inputs(45, G=1)
    y, final = chunk_ssd(inp.x, inp.dt, inp.A, inp.B, inp.C, chunk_size=16)
    y_ref, _ = naive_ssd(inp.x, inp.dt, inp.A, inp.B, inp.C)
    assert final is None
    assert rel_err(y, y_ref) < FP32_TOL


def test_recurrent_matches_naive_varlen():
    """recurrent_ssd == naive_ssd on varlen input, with checkpoints at any offset."""
    lengths = [3, 1, 0, 4]
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    h0 = random_state(len(lengths))
    ck = torch.tensor([1, 2, 3, 4, 8, 6])
    ref = naive_ssd(*inp.args(), h0, True, cu, ck)
    out = recurrent_ssd(*inp.args(), h0, True, cu, ck)
    for got, want in zip(out, ref):
        assert rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("cuts", [[8], [16, 24], [8, 16, 32, 40]])
def test_chunk_aligned_split_equals_one_shot(cuts):
    """Prefill in rounds cut at chunk multiples, passing the state on, == one-shot prefill."""
    T, cs = 45, 8
    inp = make_inputs(T)
    h0 = random_state(1)
    y_all, final_all = chunk_ssd(*inp.args(), h0, True, chunk_size=cs)
    state, pieces = h0, []
    for start, end in zip([0] + cuts, cuts + [T]):
        y, state = chunk_ssd(*inp.rows(start, end).args(), state, True, chunk_size=cs)
        pieces.append(y)
    assert rel_err(torch.cat(pieces), y_all) < 1e-6
    assert rel_err(state, final_all) < 1e-6


def test_resume_from_checkpoint_equals_scratch():
    """Resuming each sequence from a checkpoint state == the tail of a run from scratch."""
    lengths, cs = [21, 30], 8
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    ck = torch.tensor([16, 21 + 8, 21 + 24])
    y_all, final_all, states = chunk_ssd(*inp.args(), None, True, cu, ck, chunk_size=cs)
    for i, (n, p) in enumerate([(0, 16), (1, 29), (1, 45)]):
        end = cu[n + 1].item()
        y, final = chunk_ssd(*inp.rows(p, end).args(), states[i : i + 1], True, chunk_size=cs)
        assert rel_err(y, y_all[p:end]) < FP32_TOL
        assert rel_err(final[0], final_all[n]) < FP32_TOL


def test_varlen_equals_separate_runs():
    """A varlen batch of N sequences == N separate single-sequence runs (y and final states)."""
    lengths, cs = [7, 0, 19, 16], 8
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    h0 = random_state(len(lengths))
    y_all, final_all = chunk_ssd(*inp.args(), h0, True, cu, chunk_size=cs)
    for n in range(len(lengths)):
        start, end = cu[n].item(), cu[n + 1].item()
        y, final = chunk_ssd(*inp.rows(start, end).args(), h0[n : n + 1], True, chunk_size=cs)
        assert rel_err(y, y_all[start:end]) < FP32_TOL
        assert rel_err(final[0], final_all[n]) < FP32_TOL


def test_checkpoint_states_equal_truncated_final():
    """The state at checkpoint p == the final state of a run that stops at p; order is kept."""
    lengths, cs = [17, 24], 8
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    h0 = random_state(2)
    ck = torch.tensor([17 + 24, 8, 17 + 16, 16, 17, 17 + 8])
    _, _, states = chunk_ssd(*inp.args(), h0, False, cu, ck, chunk_size=cs)
    for i, p in enumerate(ck.tolist()):
        n = 0 if p <= 17 else 1
        start = cu[n].item()
        _, final = chunk_ssd(*inp.rows(start, p).args(), h0[n : n + 1], True, chunk_size=cs)
        assert rel_err(states[i], final[0]) < FP32_TOL


def test_decode_after_prefill_equals_longer_prefill():
    """Prefill then one-token decode steps (batched over sequences) == one longer prefill."""
    prompt, steps, cs = [9, 16, 5], 4, 8
    lengths = [p + steps for p in prompt]
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    h0 = random_state(3)
    y_all, final_all = chunk_ssd(*inp.args(), h0, True, cu, chunk_size=cs)
    prompt_rows = torch.cat([torch.arange(s, s + p) for s, p in zip(cu[:-1].tolist(), prompt)])
    take = lambda rows: Inputs(inp.x[rows], inp.dt[rows], inp.A, inp.B[rows], inp.C[rows], inp.D)  # noqa: E731
    _, state = chunk_ssd(*take(prompt_rows).args(), h0, True, cu_of(prompt), chunk_size=cs)
    for i in range(steps):
        rows = cu[:-1] + torch.tensor(prompt) + i
        y, state = recurrent_ssd(*take(rows).args(), state, True, cu_of([1, 1, 1]))
        assert rel_err(y, y_all[rows]) < FP32_TOL
    assert rel_err(state, final_all) < FP32_TOL


def test_initial_state_is_not_written():
    """chunk_ssd and recurrent_ssd leave initial_state untouched (the new state is returned)."""
    inp = make_inputs(10)
    h0 = random_state(1)
    kept = h0.clone()
    chunk_ssd(*inp.args(), h0, True, chunk_size=4)
    recurrent_ssd(*inp.args(), h0, True)
    assert torch.equal(h0, kept)


def test_bf16_inputs_give_bf16_outputs_and_fp32_states():
    """bf16 inputs: y in bf16 (the fp32 result rounded), final and checkpoint states fp32 and exact."""
    inp = make_inputs(20, dtype=torch.bfloat16)
    up = inp._replace(x=inp.x.float(), B=inp.B.float(), C=inp.C.float())
    ck = torch.tensor([8, 20])
    y16, f16, s16 = chunk_ssd(*inp.args(), None, True, None, ck, chunk_size=8)
    y32, f32, s32 = chunk_ssd(*up.args(), None, True, None, ck, chunk_size=8)
    assert (y16.dtype, f16.dtype, s16.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert rel_err(y16, y32) < 1e-2
    assert rel_err(f16, f32) < FP32_TOL and rel_err(s16, s32) < FP32_TOL


def test_chunk_matches_transformers_mamba2_chunk_scan():
    """chunk_ssd == transformers' NemotronH torch SSD (batched form, other chunk size) per row."""
    ref_mod = import_torch_reference(NEMOTRON_H)
    N, L = 3, 21
    inp = make_inputs(N * L, G=2)
    h0 = random_state(N)
    as_batch = lambda t: t.reshape(N, L, *t.shape[1:])  # noqa: E731
    y_ref, final_ref = ref_mod.mamba2_chunk_scan(
        as_batch(inp.x), as_batch(inp.dt), inp.A, as_batch(inp.B), as_batch(inp.C), chunk_size=16,
        D=inp.D, initial_states=h0, return_final_states=True,
    )
    y, final = chunk_ssd(*inp.args(), h0, True, cu_of([L] * N), chunk_size=8)
    assert rel_err(y, y_ref.reshape(N * L, *y.shape[1:])) < FP32_TOL
    assert rel_err(final, final_ref) < FP32_TOL


def test_recurrent_matches_transformers_selective_state_update():
    """recurrent_ssd (one token per sequence) == transformers' torch selective_state_update."""
    ref_mod = import_torch_reference(NEMOTRON_H)
    N, H, P, S = 5, 4, 8, 6
    inp = make_inputs(N, H=H, P=P, S=S)
    h0 = random_state(N)
    state = h0.clone()
    y_ref = ref_mod.mamba2_selective_state_update(
        state, inp.x, inp.dt[..., None].expand(N, H, P), inp.A[:, None, None].expand(H, P, S), inp.B, inp.C,
        inp.D[:, None].expand(H, P),
    )
    y, final = recurrent_ssd(*inp.args(), h0, True, cu_of([1] * N))
    assert rel_err(y, y_ref) < FP32_TOL
    assert rel_err(final, state) < FP32_TOL


def test_segsum_matches_transformers_segment_sum():
    """Our stable segment sums == transformers' segment_sum, -inf above the diagonal included."""
    ref_mod = import_torch_reference(NEMOTRON_H)
    a = -torch.rand(3, 2, 16, generator=torch.Generator().manual_seed(0))
    got, want = segsum(a), ref_mod.segment_sum(a)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert rel_err(got[finite], want[finite]) < FP32_TOL


def test_misaligned_checkpoint_is_rejected():
    """chunk_ssd raises ValueError naming checkpoint_at for an offset off the chunk grid."""
    inp = make_inputs(20)
    with pytest.raises(ValueError, match="checkpoint_at"):
        chunk_ssd(*inp.args(), None, False, None, torch.tensor([5]), chunk_size=8)
    with pytest.raises(ValueError, match="checkpoint_at"):
        chunk_ssd(*inp.args(), None, False, cu_of([10, 10]), torch.tensor([10, 0]), chunk_size=8)


@pytest.mark.parametrize(
    "field, bad",
    [("dt", torch.zeros(3, 4)), ("A", torch.zeros(3)), ("B", torch.zeros(20, 3, 6)), ("D", torch.zeros(2))],
)
def test_bad_shapes_name_the_argument(field, bad):
    """A mis-shaped argument raises ValueError that names it."""
    inp = make_inputs(20)._replace(**{field: bad})
    with pytest.raises(ValueError, match=rf"\b{field} must"):
        chunk_ssd(*inp.args())


def test_bad_cu_seqlens_and_initial_state_are_rejected():
    """cu_seqlens that do not cover T and an initial_state of the wrong N raise ValueError."""
    inp = make_inputs(20)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_ssd(*inp.args(), cu_seqlens=cu_of([10, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_ssd(*inp.args(), random_state(2), cu_seqlens=cu_of([20]))


# --- CUDA wrappers: their glue, on CPU, against stand-ins with the mamba-ssm conventions ---


def fake_mamba_ssm(monkeypatch):
    """Install a CPU `mamba_ssm` whose two kernels follow mamba-ssm 2.x's documented contract."""
    ref_mod = import_torch_reference(NEMOTRON_H)

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, seq_idx=None, cu_seqlens=None,
                                  return_varlen_states=False, **unused):
        assert x.dim() == 4 and x.shape[0] == 1 and seq_idx.dtype == torch.int32 and return_varlen_states
        assert torch.equal(torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff()), seq_idx[0])
        assert not unused.get("initial_states") and not unused.get("return_final_states")
        y, states = naive_ssd(x[0], dt[0], A, B[0], C[0], D, None, True, cu_seqlens)
        return y[None], states

    modules = {}
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        modules[name] = ModuleType(name)
    modules["mamba_ssm.ops.triton.ssd_combined"] = ModuleType("ssd_combined")
    modules["mamba_ssm.ops.triton.ssd_combined"].mamba_chunk_scan_combined = mamba_chunk_scan_combined
    modules["mamba_ssm.ops.triton.selective_state_update"] = ModuleType("selective_state_update")
    modules["mamba_ssm.ops.triton.selective_state_update"].selective_state_update = (
        ref_mod.mamba2_selective_state_update
    )
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_cuda_chunk_glue_matches_chunk_on_cpu(monkeypatch):
    """cuda_chunk_ssd's pieces + linear state carry == chunk_ssd (stand-in kernel, CPU)."""
    fake_mamba_ssm(monkeypatch)
    lengths, cs = [13, 0, 24, 16], 8
    inp = make_inputs(sum(lengths))
    cu = cu_of(lengths)
    h0 = random_state(len(lengths))
    ck = torch.tensor([13 + 24, 13 + 8, 8, 13 + 16, 13 + 24 + 16, 13])
    for init in (h0, None):
        want = chunk_ssd(*inp.args(), init, True, cu, ck, chunk_size=cs)
        got = cuda_chunk_ssd(*inp.args(), init, True, cu, ck, chunk_size=cs)
        for g, w in zip(got, want):
            assert rel_err(g, w) < FP32_TOL


def test_cuda_recurrent_glue_matches_recurrent_on_cpu(monkeypatch):
    """cuda_recurrent_ssd (one token per sequence) == recurrent_ssd and keeps initial_state."""
    fake_mamba_ssm(monkeypatch)
    inp = make_inputs(6)
    h0 = random_state(6)
    kept = h0.clone()
    got = cuda_recurrent_ssd(*inp.args(), h0, True, cu_of([1] * 6))
    want = recurrent_ssd(*inp.args(), h0, True, cu_of([1] * 6))
    for g, w in zip(got, want):
        assert rel_err(g, w) < FP32_TOL
    assert torch.equal(h0, kept)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_cuda_chunk_matches_torch_path(dtype, tol):
    """mamba-ssm path == torch chunk path on CUDA: varlen, initial states, checkpoints."""
    pytest.importorskip("mamba_ssm")
    lengths, cs = [300, 1, 0, 513, 128], 128
    H, P, G, S = 8, 64, 2, 64
    inp = make_inputs(sum(lengths), H=H, P=P, G=G, S=S, device="cuda", dtype=dtype)
    cu = cu_of(lengths, "cuda")
    h0 = random_state(len(lengths), H, P, S, device="cuda")
    ck = torch.tensor([128, 256, 301 + 384, 301 + 513, 814 + 128], device="cuda")
    want = chunk_ssd(*inp.args(), h0, True, cu, ck, chunk_size=cs)
    got = dispatch.get("mamba2_prefill", "cuda")(*inp.args(), h0, True, cu, ck, chunk_size=cs)
    for g, w in zip(got, want):
        assert rel_err(g, w) < tol


@pytest.mark.gpu
def test_cuda_recurrent_matches_torch_path():
    """selective_state_update path == torch decode step on CUDA (one token per sequence)."""
    pytest.importorskip("mamba_ssm")
    N, H, P, G, S = 7, 8, 64, 2, 64
    inp = make_inputs(N, H=H, P=P, G=G, S=S, device="cuda")
    h0 = random_state(N, H, P, S, device="cuda")
    want = recurrent_ssd(*inp.args(), h0, True, cu_of([1] * N, "cuda"))
    got = dispatch.get("mamba2_decode", "cuda")(*inp.args(), h0, True, cu_of([1] * N, "cuda"))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-4
