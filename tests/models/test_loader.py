import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.builtin import ByteTokenizer, random_builtin_path
from models.config import ModelConfig
from models.loader import load_model
from tests.models import harness
from tests.models.test_kimi_linear import hf_mod, tiny


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-single")
    ref = harness.save_tiny(hf_mod.KimiLinearForCausalLM, tiny("3:1"), path)
    return ref, path


def test_sharded_checkpoint_loads_same_weights(saved, tmp_path):
    """A checkpoint sharded with model.safetensors.index.json loads the same tensors."""
    ref, _ = saved
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    run = harness.PagedRunner(tmp_path)
    ids = harness.prompt(ref.config.vocab_size, 20, 0)
    (ours,) = run.step([(run.new_seq(), ids)], all_logits=True)
    assert harness.rel_err(ours, harness.hf_logits(ref, ids)) < 1e-4


def _rewrite(src, dst, edit):
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_missing_tensor_is_named(saved, tmp_path):
    """A checkpoint lacking a tensor fails with an error naming it."""
    _, path = saved
    _rewrite(path, tmp_path, lambda t: t.pop("model.layers.0.self_attn.q_conv1d.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.0.self_attn.q_conv1d.weight'\]"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(saved, tmp_path):
    """A checkpoint with a tensor the model does not have fails with an error naming it."""
    _, path = saved
    _rewrite(path, tmp_path, lambda t: t.__setitem__("model.layers.0.bogus.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.bogus.weight'\]"):
        load_model(tmp_path)


def test_wrong_shape_is_named(saved, tmp_path):
    """A tensor of the wrong shape fails with an error naming it and both shapes."""
    _, path = saved
    _rewrite(path, tmp_path, lambda t: t.__setitem__("model.norm.weight", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(3,\)"):
        load_model(tmp_path)


def test_unknown_model_type_lists_supported(saved, tmp_path):
    """An unsupported model_type is a clear error listing what is supported."""
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*kimi_linear"):
        load_model(tmp_path)


def test_no_checkpoint_folder_is_clear(tmp_path):
    """A folder without config.json is a FileNotFoundError naming the folder."""
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_model_config_validation_names_field(saved):
    """ModelConfig rejects a bad layer layout with the field's name."""
    ref, _ = saved
    cfg = ModelConfig.from_hf(ref.config)
    assert cfg.layer_kinds == ("kda", "kda", "kda", "attn")
    with pytest.raises(ValueError, match="layer_kinds: unknown kind"):
        ModelConfig(**{**cfg.__dict__, "layer_kinds": ("kda", "lstm", "kda", "attn")})
    with pytest.raises(ValueError, match="kv_shapes"):
        ModelConfig(**{**cfg.__dict__, "kv_shapes": ()})


def test_builtin_model_prefill_decode(tmp_path, monkeypatch):
    """The random-weight built-in model is created deterministically on first use and runs
    prefill + decode."""
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "a"))
    path_a = random_builtin_path()
    monkeypatch.setenv("HYBRIDSERVE_CACHE", str(tmp_path / "b"))
    path_b = random_builtin_path()
    wa, wb = load_file(path_a / "model.safetensors"), load_file(path_b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    run = harness.PagedRunner(path_a)
    assert run.cfg.layer_kinds == ("kda",) * 3 + ("attn",) + ("kda",) * 3 + ("attn",)
    tok = ByteTokenizer()
    seq = run.new_seq()
    logits = run.step([(seq, tok.encode("hello, hybrid world"))])[0]
    out = []
    for _ in range(4):
        out.append(int(logits.argmax()))
        logits = run.step([(seq, [out[-1]])])[0]
    assert torch.isfinite(logits).all() and len(seq.tokens) == len("hello, hybrid world") + 4


def test_load_dtype_keeps_reference_fp32_parameters(saved):
    """Loading in bf16 allocates every tensor once in its final dtype: bf16, except the router
    weights and biases and dt_bias, which stay fp32 as in the reference implementation."""
    _, path = saved
    model, _ = load_model(path, dtype=torch.bfloat16)
    tensors = dict([*model.named_parameters(), *model.named_buffers()])
    fp32 = {n for n, t in tensors.items() if t.dtype == torch.float32}
    assert fp32 and all(n.endswith((".gate.weight", ".e_score_correction_bias", ".dt_bias")) for n in fp32)
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in fp32)
