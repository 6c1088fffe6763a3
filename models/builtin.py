"""The built-in model: a small Kimi-Linear-architecture checkpoint with a byte tokenizer.

`builtin_path()` is the trained checkpoint shipped inside this package (models/weights/builtin:
config.json + a bf16 model.safetensors, 18.6 MB; the loader casts it to the config's float32).
It was trained for about half an hour on a 2-core CPU on the Python standard library's own
sources by scripts/train_builtin.py (docs/models.md, "The built-in model"), so its greedy
continuation of Python code reads as Python. Nothing is written or downloaded to use it.

`random_builtin_path()` is the same architecture with random but deterministic (seeded)
weights, written on first use to a cache folder (HYBRIDSERVE_CACHE, default
~/.cache/hybridserve), for tests that want weights independent of the training run. Both are
HF-layout folders and load through the same loader as any real checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

BYTE_VOCAB = 256
BOS, EOS, PAD = 256, 257, 258
VOCAB = 320  # 256 bytes + specials, padded
NAME = "hybridserve-builtin-kimi"
SEED = 1234

CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=8, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 7,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64, q_lora_rank=None, num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
    linear_num_heads=4, linear_head_dim=64, linear_conv_kernel_dim=4, model_max_length=1 << 20,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False, dtype="float32",
)


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus BOS/EOS/PAD; decoding skips specials."""

    vocab_size = VOCAB
    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        """A minimal chat format: one "<role>: content" line per message, then "assistant: "."""
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDSERVE_CACHE", Path.home() / ".cache" / "hybridserve"))


WEIGHTS = Path(__file__).resolve().parent / "weights" / "builtin"


def builtin_path() -> Path:
    """The shipped trained checkpoint folder (read-only package data)."""
    if not (WEIGHTS / "model.safetensors").is_file():
        raise FileNotFoundError(f"{WEIGHTS}: the built-in model's weights are missing (installed without the "
                                "package data models/weights/builtin/*?)")
    return WEIGHTS


def random_builtin_path() -> Path:
    """A random-weight (seeded, deterministic) checkpoint of the same architecture, created on
    first use in the cache folder."""
    path = cache_dir() / NAME
    if not (path / "model.safetensors").is_file():
        write_builtin(path)
    return path


def write_builtin(path: Path) -> None:
    """Write the seeded random-weight checkpoint (fp32) of CONFIG to `path`."""
    from safetensors.torch import save_file
    from transformers import KimiLinearConfig

    from models.kimi_linear import KimiLinearForCausalLM

    hf = KimiLinearConfig(**CONFIG)
    torch.manual_seed(SEED)
    model = KimiLinearForCausalLM(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-6.9, -2.3).exp().expm1().log())  # inverse softplus of dt
            elif p.dim() == 1:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp), metadata={"format": "pt"})
    hf.save_pretrained(path)
    tmp.rename(path / "model.safetensors")
