"""Tensor parallelism (models/layers/tensor_parallel.py): the model sharded by heads across
two gloo ranks, each loading only its slice, gives the logits of the one-rank model."""
import pytest
import torch

from hybridserve.distributed import run_ranks
from models.config import ModelConfig
from models.loader import load_hf_config
from tests.models import harness, test_context_parallel, test_nemotron_h, tp_worker
from tests.utils import rel_err

TOL = 1e-4


def nemotron_with_biases():
    """NemotronH with biases on every projection and latent MoE projections, with two B/C
    groups and two KV heads so both split across two ranks (Mamba2 chunk 32: checkpoints at 64)."""
    cfg = test_nemotron_h.tiny("*MEM-latent")
    cfg.n_groups, cfg.num_key_value_heads, cfg.chunk_size = 2, 2, 32
    return cfg


FAMILIES = {**test_context_parallel.FAMILIES,
            "nemotron-h-biases": (test_nemotron_h.hf_mod.NemotronHForCausalLM, nemotron_with_biases)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    out = {}
    for name, (cls, cfg) in FAMILIES.items():
        out[name] = tmp_path_factory.mktemp(f"tp-{name}")
        harness.save_tiny(cls, cfg(), out[name])
    return out


@pytest.fixture(scope="module")
def runs(paths):
    """{family: (one-rank logits, [rank 0 logits, rank 1 logits])}"""
    names = list(paths)
    ranks = run_ranks(_all, 2, ([str(paths[n]) for n in names],))
    return {n: (tp_worker.script(paths[n]), [r[i] for r in ranks]) for i, n in enumerate(names)}


def _all(paths: list[str]) -> list[list[torch.Tensor]]:
    return [tp_worker.script(p) for p in paths]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_logits_equal_one_rank(runs, family):
    """TP=2 logits of a prefill with a checkpoint, a mixed batch, decode steps and a resume from
    the checkpoint equal TP=1's on both ranks (fp32, rel err < 1e-4)."""
    want, got = runs[family]
    for rank, logits in enumerate(got):
        assert len(logits) == len(want)
        for i, (a, b) in enumerate(zip(logits, want)):
            err = rel_err(a, b)
            assert err < TOL, f"rank {rank}, batch output {i}: rel err {err:.2e}"


def test_sharded_shapes(paths):
    """Per-rank pool shapes: state heads and conv channels halve; GQA KV heads halve; MLA's
    one-head latent KV is replicated; an unsplittable count is refused by name."""
    kimi = ModelConfig.from_hf(load_hf_config(paths["kimi"]))
    half = kimi.sharded(2)
    assert half.kv_shapes == kimi.kv_shapes  # latent, replicated
    s, h = kimi.state_shapes[0]["recurrent"][0], half.state_shapes[0]["recurrent"][0]
    assert h == (s[0] // 2, *s[1:])
    qwen = ModelConfig.from_hf(load_hf_config(paths["qwen3-next"]))
    assert qwen.sharded(2).kv_shapes[0]["k"][0] == qwen.kv_shapes[0]["k"][0] // 2
    with pytest.raises(ValueError, match="state_shapes recurrent"):
        kimi.sharded(3)
