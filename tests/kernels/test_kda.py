"""KDA kernels, and the delta-rule invariants for both KDA and GDN (GDN reuses the machinery).

GDN-only references are in test_gdn.py; FLA's Triton kernels in test_fla_interpret.py.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch

from kernels import dispatch
from kernels.gdn import chunk_gdn, naive_gdn, recurrent_gdn
from kernels.kda import chunk_kda, naive_kda, recurrent_kda
from tests.kernels.fla_interpret import make_inputs
from tests.utils import import_torch_reference, rel_err


class Op(NamedTuple):
    name: str
    chunk: Callable
    recurrent: Callable
    naive: Callable
    scalar_gate: bool


KDA = Op("kda", chunk_kda, recurrent_kda, naive_kda, False)
GDN = Op("gdn", chunk_gdn, recurrent_gdn, naive_gdn, True)
both_ops = pytest.mark.parametrize("op", [KDA, GDN], ids=lambda op: op.name)

pytestmark = pytest.mark.usefixtures("prefill_impl")  # tests/kernels/conftest.py: compiled and torch
SIZES = dict(H=2, HV=4, K=32, V=16)  # GVA: value head h reads q/k head h // 2


def inputs(op, lengths, **kw):
    return make_inputs(lengths, op.scalar_gate, **{**SIZES, **kw})


def run(fn, x, lo, hi, state, **kw):
    """fn on tokens [lo, hi) of one sequence starting from `state` [1, HV, K, V]."""
    q, k, v, g, beta = (t[lo:hi] for t in x[:5])
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, **kw)


@both_ops
@pytest.mark.parametrize("path", ["chunk", "recurrent"])
def test_fast_paths_match_naive_varlen(op, path):
    """chunk and recurrent paths == the fp32 token loop on a varlen GVA batch (rel < 1e-5)."""
    q, k, v, g, beta, h0, cu = inputs(op, [100, 64, 1, 0, 70])
    ckpt = torch.tensor([64, 100, 164, 229, 165], dtype=torch.int64)
    args = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, checkpoint_at=ckpt)
    o, final, states = getattr(op, path)(q, k, v, g, beta, **args)
    o_ref, final_ref, states_ref = op.naive(q, k, v, g, beta, **args)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(final, final_ref) < 1e-5
    assert rel_err(states, states_ref) < 1e-5


@both_ops
@pytest.mark.parametrize("decay", ["tiny", "uniform_to_-8", "constant_-8", "below_clamp_-60"])
def test_chunk_exact_for_tiny_and_strong_decays(op, decay):
    """The chunk path stays finite and == the token loop (rel < 1e-5) for any log decay."""
    x = list(inputs(op, [200]))
    g = x[3]
    x[3] = {"tiny": g * 1e-4, "uniform_to_-8": g * 4, "constant_-8": torch.full_like(g, -8.0),
            "below_clamp_-60": g * 30}[decay]
    o, final = run(op.chunk, x, 0, 200, x[5])
    o_ref, final_ref = run(op.naive, x, 0, 200, x[5])
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(final, final_ref) < 1e-5


@both_ops
@pytest.mark.parametrize("cut", [64, 128, 192])
def test_chunk_aligned_split_equals_one_shot(op, cut):
    """Prefill in two calls cut at a multiple of 64, chaining the state == one call."""
    x = inputs(op, [230])
    o, final = run(op.chunk, x, 0, 230, x[5])
    o1, mid = run(op.chunk, x, 0, cut, x[5])
    o2, final2 = run(op.chunk, x, cut, 230, mid)
    assert rel_err(torch.cat([o1, o2]), o) < 1e-6
    assert rel_err(final2, final) < 1e-6


@both_ops
def test_resume_from_checkpoint_equals_from_scratch(op):
    """Resuming from a returned checkpoint state reproduces the rest of a one-shot run."""
    x = inputs(op, [250])
    o, final, states = run(op.chunk, x, 0, 250, x[5], checkpoint_at=torch.tensor([128, 64]))
    for i, p in enumerate([128, 64]):
        o_rest, final_rest = run(op.chunk, x, p, 250, states[i:i + 1])
        assert rel_err(o_rest, o[p:]) < 1e-6
        assert rel_err(final_rest, final) < 1e-6


@both_ops
def test_varlen_equals_separate_runs(op):
    """A varlen batch of N sequences == N separate single-sequence runs."""
    lengths = [100, 64, 1, 0, 130]
    x = inputs(op, lengths)
    q, k, v, g, beta, h0, cu = x
    o, final = op.chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    for n in range(len(lengths)):
        o_n, final_n = run(op.chunk, x, cu[n], cu[n + 1], h0[n:n + 1])
        assert rel_err(o_n, o[cu[n]:cu[n + 1]]) < 1e-6
        assert rel_err(final_n, final[n:n + 1]) < 1e-6


@both_ops
def test_checkpoint_states_equal_truncated_runs(op):
    """Checkpoint states (in the order given) == final states of runs stopped there (or at an end)."""
    x = inputs(op, [130, 64, 200])
    q, k, v, g, beta, h0, cu = x
    ckpt = torch.tensor([258, 130, 64, 194, 322, 394], dtype=torch.int64)  # unsorted, mixed sequences
    _, final, states = op.chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, checkpoint_at=ckpt)
    for i, p in enumerate(ckpt.tolist()):
        n = int(torch.searchsorted(cu, p, side="left")) - 1
        _, truncated = run(op.chunk, x, cu[n], p, h0[n:n + 1])
        assert rel_err(states[i], truncated[0]) < 1e-6
    assert torch.equal(states[[1, 3, 5]], final)


@both_ops
def test_decode_steps_after_prefill_equal_longer_prefill(op):
    """Three one-token decode steps per sequence after a prefill == prefilling all tokens."""
    prompt, steps = [70, 128, 5], 3
    x = inputs(op, [n + steps for n in prompt])
    q, k, v, g, beta, h0, cu = x
    o_ref, final_ref = op.chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    pre = torch.cat([torch.arange(a, a + n) for a, n in zip(cu[:-1].tolist(), prompt)])
    cu_pre = torch.tensor([0] + prompt).cumsum(0)
    o_pre, state = op.chunk(*(t[pre] for t in x[:5]), initial_state=h0, output_final_state=True,
                            cu_seqlens=cu_pre)
    assert rel_err(o_pre, o_ref[pre]) < 1e-6
    for s in range(steps):
        tok = torch.tensor([a + n + s for a, n in zip(cu[:-1].tolist(), prompt)])
        o_tok, state = op.recurrent(*(t[tok] for t in x[:5]), initial_state=state, output_final_state=True,
                                    cu_seqlens=torch.arange(len(prompt) + 1))
        assert rel_err(o_tok, o_ref[tok]) < 1e-5
    assert rel_err(state, final_ref) < 1e-5


@both_ops
def test_dtypes_and_initial_state_untouched(op):
    """o comes back in v's dtype, states in fp32, and initial_state is not modified."""
    q, k, v, g, beta, h0, cu = inputs(op, [70, 30])
    h0_copy = h0.clone()
    for fn in (op.chunk, op.recurrent):
        o, final, states = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, initial_state=h0,
                              output_final_state=True, cu_seqlens=cu, checkpoint_at=torch.tensor([64]))
        assert o.dtype == torch.bfloat16 and final.dtype == torch.float32 and states.dtype == torch.float32
        assert torch.equal(h0, h0_copy)
        assert fn(q, k, v, g, beta, cu_seqlens=cu)[1] is None


def test_matches_fla_naive_kda():
    """chunk_kda == FLA's pure-torch naive_recurrent_kda and naive_chunk_kda (GVA, rel < 1e-5)."""
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    q, k, v, g, beta, h0, _ = inputs(KDA, [192])
    o, final = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for ref in (naive_recurrent_kda, naive_chunk_kda):
        o_ref, final_ref = ref(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                               output_final_state=True)
        assert rel_err(o, o_ref[0]) < 1e-5
        assert rel_err(final, final_ref) < 1e-5


def test_matches_transformers_kimi_linear():
    """chunk_kda == transformers' torch chunk/recurrent KDA of kimi_linear (no GVA there; rel < 1e-5)."""
    kimi = import_torch_reference("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, h0, _ = inputs(KDA, [150], HV=2)
    o, final = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for ref in (kimi.chunk_kimi_delta_attention, kimi.recurrent_kimi_delta_attention):
        o_ref, final_ref = ref(q[None], k[None], v[None], g[None], beta[None], initial_state=h0,
                               output_final_state=True)
        assert rel_err(o, o_ref[0]) < 1e-5
        assert rel_err(final, final_ref) < 1e-5


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda, naive_kda])
def test_bad_arguments_raise_value_error_naming_them(fn):
    """Wrong shapes, dtypes, cu_seqlens or checkpoint positions raise ValueError naming the argument."""
    q, k, v, g, beta, h0, cu = inputs(KDA, [100, 28])
    bad = {
        "g": dict(g=g[..., :-1]),
        "beta": dict(beta=beta[:, :1]),
        "v": dict(v=v[:, :3]),
        "initial_state": dict(initial_state=h0.double(), cu_seqlens=cu),
        "cu_seqlens": dict(cu_seqlens=torch.tensor([0, 50, 127])),
        "checkpoint_at": dict(cu_seqlens=cu, checkpoint_at=torch.tensor([120])),
    }
    for name, override in bad.items():
        args = {**dict(q=q, k=k, v=v, g=g, beta=beta), **override}
        with pytest.raises(ValueError, match=name):
            fn(**args)


def test_dispatch_registry_points_here():
    """kernels.dispatch resolves the KDA / GDN CPU ops to these functions."""
    assert dispatch.get("kda_prefill", "cpu") is chunk_kda
    assert dispatch.get("kda_decode", "cpu") is recurrent_kda
    assert dispatch.get("gdn_prefill", "cpu") is chunk_gdn
    assert dispatch.get("gdn_decode", "cpu") is recurrent_gdn


@pytest.mark.gpu
@both_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_on_cuda_matches_torch(op, dtype):
    """FLA prefill (varlen, GVA, checkpoints) and decode on CUDA == torch, within TF32 / bf16 error."""
    from kernels.gdn.fla import fla_chunk_gdn, fla_recurrent_gdn
    from kernels.kda.fla import fla_chunk_kda, fla_recurrent_kda
    fla_paths = {"kda": (fla_chunk_kda, fla_recurrent_kda),
                 "gdn": (fla_chunk_gdn, fla_recurrent_gdn)}[op.name]
    tol = 5e-3 if dtype == torch.float32 else 3e-2
    q, k, v, g, beta, h0, cu = inputs(op, [300, 64, 129, 3], K=128, V=128)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    prefill = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu,
                   checkpoint_at=torch.tensor([64, 300, 428, 493, 496]))
    decode = dict(output_final_state=True, cu_seqlens=torch.arange(5))
    tok = cu[:-1]  # one token per sequence for the decode step
    for fla_fn, torch_fn, x, args in ((fla_paths[0], op.chunk, (q, k, v, g, beta), prefill),
                                      (fla_paths[1], op.recurrent, [t[tok] for t in (q, k, v, g, beta)],
                                       dict(decode, initial_state=h0))):
        want = torch_fn(*x, **args)
        got = fla_fn(*(t.cuda() for t in x), **{key: val.cuda() if torch.is_tensor(val) else val
                                                 for key, val in args.items()})
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.device.type == "cuda"
            assert rel_err(a.cpu(), b) < tol
