"""Context-parallel prefill (models/layers/context_parallel.py): one segment split across
gloo ranks gives the logits, final states, checkpoints and KV of the one-rank run."""
import pytest
import torch

from hybridserve.distributed import run_ranks
from models.layers.context_parallel import split_bounds
from tests.models import cp_worker, harness, test_kimi_linear, test_nemotron_h, test_qwen3_next
from tests.utils import rel_err

FAMILIES = {  # name -> (reference class, tiny config); NemotronH's Mamba2 chunk is 32 here
    "kimi": (test_kimi_linear.hf_mod.KimiLinearForCausalLM, lambda: test_kimi_linear.tiny("1:1-qlora")),
    "qwen3-next": (test_qwen3_next.hf_mod.Qwen3NextForCausalLM, lambda: test_qwen3_next.tiny("3:1-gqa2")),
    "nemotron-h": (test_nemotron_h.hf_mod.NemotronHForCausalLM, lambda: test_nemotron_h.tiny("ME*M-")),
}
# 40 prefix tokens (the segment resumes from states and KV), a 290-token segment, checkpoints
# 64 and 256 tokens in: with 2 ranks cut at 128 each rank owns one; with 3 at 128 and 192
IDS, PREFIX, CHECKPOINTS, ALIGN = harness.prompt(97, 330, 11), 40, [64, 256], 64
TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(family, world): per-rank results}, world 1 run in this process."""
    cases = {}
    for name, (cls, cfg) in FAMILIES.items():
        path = tmp_path_factory.mktemp(f"cp-{name}")
        harness.save_tiny(cls, cfg(), path)
        cases[name] = (path, IDS, PREFIX, CHECKPOINTS, ALIGN)
    out = {(name, 1): [cp_worker.forward(*case)] for name, case in cases.items()}
    for rank_results in zip(*run_ranks(cp_worker.forward_all, 2, (list(cases.values()),))):
        name = list(cases)[len([k for k in out if k[1] == 2])]
        out[(name, 2)] = list(rank_results)
    out[("kimi", 3)] = run_ranks(cp_worker.forward, 3, cases["kimi"])
    return out


def _close(a, b, what):
    err = rel_err(a, b)
    assert err < TOL, f"{what}: rel err {err:.2e} >= {TOL}"


@pytest.mark.parametrize("family,world", [("kimi", 2), ("qwen3-next", 2), ("nemotron-h", 2), ("kimi", 3)])
def test_context_parallel_prefill_equals_one_rank(runs, family, world):
    """CP=world logits of every token, the final states, both checkpoints (one per rank) and the
    segment's KV, on every rank, equal the one-rank run (fp32, rel err < 1e-4)."""
    (ref,) = runs[(family, 1)]
    for rank, got in enumerate(runs[(family, world)]):
        _close(got["logits"], ref["logits"], f"rank {rank} logits")
        for i, (layer, want) in enumerate(zip(got["states"], ref["states"])):
            for name in want:
                for j, what in enumerate(["final state", "checkpoint 64", "checkpoint 256"]):
                    _close(layer[name][j], want[name][j], f"rank {rank} linear layer {i} {name} {what}")
        for i, (layer, want) in enumerate(zip(got["kv"], ref["kv"])):
            for name in want:
                _close(layer[name], want[name], f"rank {rank} attention layer {i} {name}")


def test_split_bounds():
    """Slices are cut on the alignment grid, cover every token once, and none is empty."""
    assert split_bounds(290, 2, 64) == (0, 128, 290)
    assert split_bounds(290, 3, 64) == (0, 128, 192, 290)
    assert split_bounds(4096, 4, 64) == (0, 1024, 2048, 3072, 4096)
    with pytest.raises(ValueError, match="cannot give 3 slices"):
        split_bounds(150, 3, 64)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL ranks need a device each)")
def test_context_parallel_on_nccl(tmp_path):
    """The CUDA path: CP=2 over NCCL with the CUDA kernels equals one GPU (fp32, rel err < 1e-4)."""
    cls, cfg = FAMILIES["kimi"]
    harness.save_tiny(cls, cfg(), tmp_path)
    case = (tmp_path, IDS, PREFIX, CHECKPOINTS, ALIGN, "cuda")
    ref = cp_worker.forward(*case)
    for got in run_ranks(cp_worker.forward, 2, case, backend="nccl"):
        _close(got["logits"], ref["logits"], "logits")
