"""The decoder-only skeleton shared by the hybrid models: embed -> blocks -> norm -> lm_head."""
from __future__ import annotations

import torch
from torch import nn

from models.batch import ForwardBatch
from models.layers.linear import Linear
from models.layers.norm import RMSNorm


class Backbone(nn.Module):
    """`<prefix>.*` of an HF checkpoint: the embedding, the layers and the final norm, under
    the names the checkpoint uses (`names` = (embedding, final norm))."""

    def __init__(self, hf, block_cls, kinds: tuple[str, ...], eps: float, norm_offset: float,
                 names: tuple[str, str]):
        super().__init__()
        self.embed_name, self.norm_name = names
        self.add_module(self.embed_name, nn.Embedding(hf.vocab_size, hf.hidden_size))
        ordinal = {"attn": 0, "linear": 0, "mlp": 0}
        blocks = []
        for i, kind in enumerate(kinds):
            group = kind if kind in ("attn", "mlp") else "linear"
            blocks.append(block_cls(hf, i, ordinal[group]))
            ordinal[group] += 1
        self.layers = nn.ModuleList(blocks)
        self.add_module(self.norm_name, RMSNorm(hf.hidden_size, eps, offset=norm_offset))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [L, D] at batch.logits_at."""
        x, residual = getattr(self, self.embed_name)(batch.input_ids), None
        for block in self.layers:
            x, residual = block(x, residual, batch)
        norm = getattr(self, self.norm_name)
        if batch.every_token:
            return norm.add(x, residual)[0]
        at = batch.logits_at
        return norm.add(x[at], residual[at] if residual is not None else None)[0]


class CausalLM(nn.Module):
    """Subclasses define `layer_kinds(hf)` and `model_config(hf, dtype)` and pass their block class.

    Blocks are built as `block_cls(hf, layer_index, mixer_index)`, mixer_index being the
    ordinal of the layer among the attention layers (its KV buffer) or among the linear
    layers (its state buffer), and run `forward(x, residual, batch) -> (x, residual)` (all
    [T, D]): the residual stream is `x + residual` (x alone before the first block), carried
    unsummed so each block's norm adds it in the same pass (`RMSNorm.add`).
    """

    # checkpoint names of the backbone, its embedding and its final norm
    prefix, embed_name, norm_name = "model", "embed_tokens", "norm"
    # parameter names (dotted suffixes) kept in fp32 whatever the load dtype, as the references do
    keep_fp32: tuple[str, ...] = ()
    # checkpoint tensors the engine does not use (e.g. multi-token-prediction heads)
    ignore_prefixes: tuple[str, ...] = ()
    norm_offset: float = 0.0

    def __init__(self, hf, block_cls, eps: float):
        super().__init__()
        names = (self.embed_name, self.norm_name)
        self.add_module(self.prefix, Backbone(hf, block_cls, self.layer_kinds(hf), eps, self.norm_offset, names))
        self.lm_head = Linear(hf.hidden_size, hf.vocab_size, bias=False)
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        self.tie_weights()

    @property
    def decoder(self) -> Backbone:
        return getattr(self, self.prefix)

    def tie_weights(self) -> None:
        """lm_head shares the embedding when the config ties them (again after `to_empty`)."""
        if self.tied:
            self.lm_head.weight = getattr(self.decoder, self.embed_name).weight

    def from_checkpoint(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the parameter `name` holds it: the innermost module above it
        with a `from_checkpoint(rest_of_name, t)` (a layout of its own) converts it, else t."""
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = self.get_submodule(".".join(parts[:cut]))
            convert = getattr(module, "from_checkpoint", None)
            if convert is not None:
                return convert(".".join(parts[cut:]), t)
        return t

    @staticmethod
    def layer_kinds(hf) -> tuple[str, ...]:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [L, vocab] (fp32) at batch.logits_at; KV and states are updated in batch.memory."""
        return self.lm_head(self.decoder(batch)).float()
