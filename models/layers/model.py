"""The decoder-only skeleton shared by the hybrid models: embed -> blocks -> norm -> lm_head."""
from __future__ import annotations

import torch
from torch import nn

from models.batch import ForwardBatch
from models.layers.norm import RMSNorm


class Backbone(nn.Module):
    """`model.*` of an HF checkpoint: embed_tokens, layers, norm."""

    def __init__(self, hf, block_cls, kinds: tuple[str, ...], eps: float, norm_offset: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(hf.vocab_size, hf.hidden_size)
        ordinal = {"attn": 0, "linear": 0, "mlp": 0}
        blocks = []
        for i, kind in enumerate(kinds):
            group = kind if kind in ("attn", "mlp") else "linear"
            blocks.append(block_cls(hf, i, ordinal[group]))
            ordinal[group] += 1
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(hf.hidden_size, eps, offset=norm_offset)


class CausalLM(nn.Module):
    """Subclasses define `layer_kinds(hf)` and `model_config(hf)` and pass their block class.

    Blocks are built as `block_cls(hf, layer_index, mixer_index)`, mixer_index being the
    ordinal of the layer among the attention layers (its KV buffer) or among the linear
    layers (its state buffer), and run `forward(x [T, D], batch) -> [T, D]`.
    """

    # parameters kept in fp32 whatever the load dtype (as the reference implementations do)
    keep_fp32: tuple[str, ...] = ("e_score_correction_bias", "gate.weight", "dt_bias")
    norm_offset: float = 0.0

    def __init__(self, hf, block_cls, eps: float):
        super().__init__()
        self.model = Backbone(hf, block_cls, self.layer_kinds(hf), eps, self.norm_offset)
        self.lm_head = nn.Linear(hf.hidden_size, hf.vocab_size, bias=False)
        if getattr(hf, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def layer_kinds(hf) -> tuple[str, ...]:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [L, vocab] (fp32) at batch.logits_at; KV and states are updated in batch.memory."""
        x = self.model.embed_tokens(batch.input_ids)
        for block in self.model.layers:
            x = block(x, batch)
        x = self.model.norm(x[batch.logits_at])
        return self.lm_head(x).float()
