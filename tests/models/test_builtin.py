"""The built-in model: the shipped trained weights (models/weights/builtin) and the seeded
random-weight checkpoint (random_builtin_path)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from models.builtin import CONFIG, ByteTokenizer, builtin_path, random_builtin_path
from models.loader import load_hf_config, load_model
from tests.models import harness
from tests.models.test_kimi_linear import hf_mod

# Python written for this test (not a file of the training set, which is the stdlib).
SNIPPET = '''def moving_average(values, window):
    """Return the mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]
'''
LAYERS = ("kda",) * 3 + ("attn",) + ("kda",) * 3 + ("attn",)
N_PARAMS = 9_302_424


def cross_entropy(path, text: str = SNIPPET) -> float:
    """Mean next-byte cross-entropy (nats) of our engine's model over `text` (no BOS, as the
    engine encodes prompts)."""
    ids = ByteTokenizer().encode(text)
    run = harness.PagedRunner(path)
    (logits,) = run.step([(run.new_seq(), ids)], all_logits=True)
    return F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item()


@pytest.fixture(scope="module")
def random_path(tmp_path_factory):
    import os

    old = os.environ.get("HYBRIDSERVE_CACHE")
    os.environ["HYBRIDSERVE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return random_builtin_path()
    finally:
        if old is None:
            del os.environ["HYBRIDSERVE_CACHE"]
        else:
            os.environ["HYBRIDSERVE_CACHE"] = old


def test_shipped_weights_are_bf16_small_and_load_with_the_builtin_architecture():
    """The shipped folder is inside the package, <= 20 MB, every tensor bf16 on disk; its
    config is exactly CONFIG and it loads through load_model (in the config's float32)."""
    path = builtin_path()
    assert path.parent.name == "weights" and (path / "config.json").is_file()
    st = path / "model.safetensors"
    assert st.stat().st_size <= 20 * 2**20
    with safe_open(str(st), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert dtypes == {"BF16"} and n == N_PARAMS + sum(CONFIG["mlp_layer_types"][i] == "sparse" for i in range(8)) * 8
    hf = load_hf_config(path)
    for key, value in CONFIG.items():
        got = getattr(hf, key)
        assert str(got).removeprefix("torch.") == str(value), (key, got, value)
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    model, cfg = load_model(path)
    assert cfg.layer_kinds == LAYERS and cfg.vocab_size == CONFIG["vocab_size"]
    assert sum(p.numel() for p in model.parameters()) == N_PARAMS
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_shipped_model_was_trained_on_python(random_path):
    """On Python it has not seen, the trained model's next-byte cross-entropy is far below the
    random model's (which is about ln 256 = 5.5 nats or worse)."""
    trained, rand = cross_entropy(builtin_path()), cross_entropy(random_path)
    assert rand > 4.5, rand
    assert trained < 2.5, trained


def test_shipped_model_matches_the_training_reference():
    """Our engine's forward of the shipped weights equals transformers' KimiLinearForCausalLM
    (the model the training script trained) on the snippet."""
    ids = ByteTokenizer().encode(SNIPPET[:300])
    ref = hf_mod.KimiLinearForCausalLM.from_pretrained(builtin_path(), dtype=torch.float32).eval()
    run = harness.PagedRunner(builtin_path())
    (ours,) = run.step([(run.new_seq(), ids)], all_logits=True)
    assert harness.rel_err(ours, harness.hf_logits(ref, ids)) < 1e-4


def test_random_builtin_is_deterministic_and_untrained(random_path, tmp_path, monkeypatch):
    """random_builtin_path() writes the same seeded fp32 weights in any cache folder, with the
    same architecture as the shipped model and none of its values."""
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path))
    other = random_builtin_path()
    assert other != random_path and other.parent == tmp_path
    wa, wb = load_file(random_path / "model.safetensors"), load_file(other / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(t.dtype == torch.float32 for t in wa.values())
    shipped = load_file(builtin_path() / "model.safetensors")
    assert shipped.keys() == wa.keys()
    assert all(shipped[k].shape == wa[k].shape for k in wa)
    assert not torch.equal(shipped["lm_head.weight"].float(), wa["lm_head.weight"])
    assert random_builtin_path() == other  # second use: the existing folder
    _, cfg = load_model(other)
    assert cfg.layer_kinds == LAYERS
