"""HF `model_type` -> model class, one explicit table; classes are imported on first use."""
from __future__ import annotations

import importlib

_MODELS = {
    "kimi_linear": "models.kimi_linear:KimiLinearForCausalLM",
    "qwen3_next": "models.qwen3_next:Qwen3NextForCausalLM",
    "nemotron_h": "models.nemotron_h:NemotronHForCausalLM",
}


def model_types() -> list[str]:
    return sorted(_MODELS)


def model_class(model_type: str):
    """The model class for an HF model_type; ValueError listing the supported types."""
    if model_type not in _MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {model_types()}")
    module, name = _MODELS[model_type].split(":")
    return getattr(importlib.import_module(module), name)
