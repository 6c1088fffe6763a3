"""The tiny random-weight hybrid checkpoints of the peer benchmark (benchmarks/peers.py).

Each is a folder in the Hugging Face layout (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) that hybridserve and vLLM load alike. The tokenizer is a word-level
one over "t4".."tN" (ids 0..3 are <pad> <s> </s> <unk>), split on whitespace, so that
decode -> encode gives back the ids (`vllm bench serve`'s random dataset relies on it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 4096
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3: pad, bos, eos, unk

# vLLM's CPU GDN kernel takes linear head dims 64 or 128 only, keys as wide as values.
QWEN3_NEXT: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    shared_expert_intermediate_size=256, num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=8192,
)
NEMOTRON_H: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=256, hybrid_override_pattern="M-M*M-M-", intermediate_size=512,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, mamba_num_heads=8, mamba_head_dim=64, n_groups=1,
    ssm_state_size=32, conv_kernel=4, chunk_size=128, max_position_embeddings=8192,
    time_step_limit=(0.0, 1e9),  # (0, inf) is the default; inf does not survive JSON
)


@dataclass(frozen=True)
class PeerModel:
    name: str  # folder name
    module: str  # transformers modeling module
    cls: str  # its causal-LM class
    config_cls: str
    settings: dict[str, Any]
    dtype: str  # the dtype both engines run


MODELS = {
    "qwen3-next": PeerModel("qwen3-next", "transformers.models.qwen3_next.modeling_qwen3_next",
                            "Qwen3NextForCausalLM", "Qwen3NextConfig", QWEN3_NEXT, "bfloat16"),
    "nemotron-h": PeerModel("nemotron-h", "transformers.models.nemotron_h.modeling_nemotron_h",
                            "NemotronHForCausalLM", "NemotronHConfig", NEMOTRON_H, "float32"),
}


def build(name: str, cache: Path, seed: int = 0) -> tuple[Path, int]:
    """The checkpoint folder of MODELS[name] under `cache` (built once per settings and seed) and its
    parameter count."""
    spec = MODELS[name]
    path = cache / spec.name
    done = path / "params.json"
    stamp = {"seed": seed, "settings": json.loads(json.dumps(spec.settings))}
    if done.is_file() and json.loads(done.read_text()).get("stamp") == stamp:
        return path, json.loads(done.read_text())["params"]
    from tests.models.harness import save_tiny
    from tests.utils import import_torch_reference

    mod = import_torch_reference(spec.module)  # binds the torch kernels (FLA is CUDA-only)
    import transformers

    config = getattr(transformers, spec.config_cls)(pad_token_id=0, bos_token_id=1, eos_token_id=2, **spec.settings)
    ref = save_tiny(getattr(mod, spec.cls), config, path, seed=seed)
    dtype = getattr(torch, spec.dtype)
    ref.to(dtype).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = cfg["torch_dtype"] = spec.dtype
    if "hybrid_override_pattern" in spec.settings:  # transformers < 5 reads the layout from the pattern
        cfg["hybrid_override_pattern"] = spec.settings["hybrid_override_pattern"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_tokenizer(path)
    params = sum(p.numel() for p in ref.parameters())
    done.write_text(json.dumps({"params": params, "stamp": stamp}) + "\n")
    return path, params


def save_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over `vocab` ids (SPECIAL, then t4, t5, ...), saved as a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {w: i for i, w in enumerate(SPECIAL)} | {f"t{i}": i for i in range(len(SPECIAL), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=QWEN3_NEXT["max_position_embeddings"])
    fast.save_pretrained(path)
