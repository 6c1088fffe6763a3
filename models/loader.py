"""Load a local HF checkpoint directory: config.json + *.safetensors (single or sharded).

Parameter names are the checkpoint's own; every model parameter must be found and every
checkpoint tensor must be used, else a ValueError names the tensors. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ModelConfig
from models.layers.tensor_parallel import TensorParallel, shard_model
from models.registry import model_class


def load_hf_config(path: str | Path):
    """The transformers config of a local checkpoint folder (no hub access)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a local checkpoint folder)")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               tp: TensorParallel | None = None, state_dtype: torch.dtype | None = None):
    """Build the model for a checkpoint folder and load its weights.

    Returns (model, ModelConfig). `dtype` defaults to the checkpoint's declared dtype;
    parameters the model lists in `keep_fp32` stay fp32; recurrent states are kept in `state_dtype`
    (default: the model's, fp32 but for a NemotronH checkpoint that declares another). With `tp` the model holds this
    rank's shard (models/layers/tensor_parallel.py) and the config its per-rank shapes: each
    checkpoint tensor is read, cut and dropped, so a rank holds its shard plus one tensor.
    """
    path = Path(path)
    hf = load_hf_config(path)
    cfg = ModelConfig.from_hf(hf, dtype)
    if state_dtype is not None:
        cfg = cfg.with_state_dtype(state_dtype)
    dtype = cfg.dtype
    with torch.device("meta"):
        model = model_class(hf.model_type)(hf)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # dtypes set on meta: free
        fp32 = any(name == k or name.endswith("." + k) for k in model.keep_fp32)
        t.data = t.data.to(torch.float32 if fp32 else dtype)
    if tp is not None and tp.world > 1:
        shard_model(model, tp)
        cfg = cfg.sharded(tp.world)
    slices = {n: p.tp_slice for n, p in model.named_parameters() if hasattr(p, "tp_slice")}
    model.to_empty(device=device)  # the only allocation, in the final dtypes
    model.tie_weights()  # to_empty made new tensors: re-share lm_head with the embedding
    params = dict(model.state_dict())  # tied weights appear under both names
    seen: set[str] = set()
    unexpected = []
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(model.ignore_prefixes):
                    continue
                if name not in params:
                    unexpected.append(name)
                    continue
                t = model.from_checkpoint(name, f.get_tensor(name))
                if name in slices:
                    t = slices[name](t)
                dst = params[name]
                if t.shape != dst.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(dst.shape)}")
                dst.copy_(t)  # casts to the parameter's dtype
                seen.add(name)
    tied = {"lm_head.weight"} if model.tied else set()
    missing = sorted(set(params) - seen - tied)
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:10]} ({len(missing)}), "
                         f"unexpected tensors {sorted(unexpected)[:10]} ({len(unexpected)})")
    return model.eval(), cfg
