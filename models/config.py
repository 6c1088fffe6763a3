"""ModelConfig: the engine-facing facts of a model, converted once from its HF config.

Model classes still build their modules from the HF config (as serving engines do);
everything the engine, the pools and the scheduler need is here, validated, so nothing
outside `models/` reads the HF config.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

LINEAR_KINDS = ("kda", "gdn", "mamba2")
LAYER_KINDS = LINEAR_KINDS + ("attn", "mlp")  # "mlp": a stateless block (NemotronH)

KVShapes = Mapping[str, tuple[int, ...]]  # name -> per-token shape, one attention layer
StateShapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (per-slot shape, dtype)


@dataclass(frozen=True)
class ModelConfig:
    """Validated description of a hybrid model for the engine.

    layer_kinds[i] is the kind of layer i; kv_shapes has one entry per "attn" layer (in
    layer order), state_shapes one per linear layer; kernel_chunks gives the chunk size of
    the chunkwise kernel of each linear kind present (the checkpoint grid divides by it).
    dtype: what the model runs in (weights, activations, KV); may differ from the declared one.
    """

    model_type: str
    layer_kinds: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    max_position: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    kv_shapes: tuple[KVShapes, ...]
    state_shapes: tuple[StateShapes, ...]
    kernel_chunks: Mapping[str, int]
    hf: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        bad = [k for k in self.layer_kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer_kinds: unknown kind(s) {bad}; known: {list(LAYER_KINDS)}")
        if not self.layer_kinds:
            raise ValueError("layer_kinds: a model needs at least one layer")
        if len(self.kv_shapes) != len(self.attn_layers):
            raise ValueError(f"kv_shapes: {len(self.kv_shapes)} entries for {len(self.attn_layers)} attn layers")
        if len(self.state_shapes) != len(self.linear_layers):
            raise ValueError(
                f"state_shapes: {len(self.state_shapes)} entries for {len(self.linear_layers)} linear layers"
            )
        missing = {self.layer_kinds[i] for i in self.linear_layers} - set(self.kernel_chunks)
        if missing:
            raise ValueError(f"kernel_chunks: no chunk size for linear kind(s) {sorted(missing)}")
        for name in ("vocab_size", "hidden_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "attn")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in LINEAR_KINDS)

    def sharded(self, world: int) -> "ModelConfig":
        """Per-rank shapes under tensor parallelism over `world` ranks: every state's first
        dim (heads, or conv channels made of heads) and the KV heads split; a one-head KV (MLA's
        latent) is replicated."""
        def split(shape: tuple[int, ...], what: str) -> tuple[int, ...]:
            if shape[0] % world:
                raise ValueError(f"{what}: {shape[0]} cannot be split across {world} ranks")
            return (shape[0] // world, *shape[1:])

        kv = tuple({n: s if s[0] == 1 else split(s, f"kv_shapes {n}") for n, s in layer.items()}
                   for layer in self.kv_shapes)
        state = tuple({n: (split(s, f"state_shapes {n}"), dt) for n, (s, dt) in layer.items()}
                      for layer in self.state_shapes)
        return replace(self, kv_shapes=kv, state_shapes=state)

    def with_state_dtype(self, dtype: torch.dtype) -> "ModelConfig":
        """The same model with its recurrent states ("recurrent", not the conv tails) kept in
        `dtype`: bf16 halves the bytes a decode step reads and writes and a checkpoint takes."""
        state = tuple({n: (s, dtype if n == "recurrent" else dt) for n, (s, dt) in layer.items()}
                      for layer in self.state_shapes)
        return replace(self, state_shapes=state)

    @classmethod
    def uniform(cls, hf, kinds: tuple[str, ...], kv: KVShapes, state: StateShapes,
                kernel_chunks: Mapping[str, int], dtype: torch.dtype) -> "ModelConfig":
        """A config whose attention layers share one KV layout and linear layers one state
        layout (true of every supported model); the rest is read from the HF config."""
        return cls(
            model_type=hf.model_type,
            layer_kinds=kinds,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            max_position=hf.max_position_embeddings,
            eos_token_ids=eos_ids(hf),
            dtype=dtype,
            kv_shapes=tuple(kv for k in kinds if k == "attn"),
            state_shapes=tuple(state for k in kinds if k in LINEAR_KINDS),
            kernel_chunks=kernel_chunks,
            hf=hf,
        )

    @classmethod
    def from_hf(cls, hf_config, dtype: torch.dtype | None = None) -> "ModelConfig":
        """Convert a transformers config (e.g. `AutoConfig.from_pretrained(path)`) for running
        in `dtype` (default: the checkpoint's): states kept in the activation dtype (conv
        tails) take it, recurrent states keep the dtype the model declares (fp32)."""
        from models.registry import model_class

        return model_class(hf_config.model_type).model_config(hf_config, dtype or hf_dtype(hf_config))


def hf_dtype(hf_config, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The weight dtype a checkpoint declares (`dtype` / `torch_dtype`), else `default`."""
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if dt is None:
        return default
    return dt if isinstance(dt, torch.dtype) else getattr(torch, str(dt))


def eos_ids(hf_config) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
