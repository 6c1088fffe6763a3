"""EngineInfo: what a front needs of an engine without holding its model.

A server front validates and tokenizes a request before it hands it to the engine, which
may run in another process (hybridserve/engine_process.py): it needs the model's names, its
limits and the prompt checks `Engine.add_request` makes, all here. The engine builds one
(`Engine.info`); a front in another process gets its numbers and loads its own tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

from hybridserve.config import EngineConfig
from hybridserve.sampling import SamplingParams

Prompt = Union[str, Sequence[int], dict]  # text, token ids, {"prompt": ...} or {"prompt_token_ids": ...}


@dataclass(frozen=True)
class EngineInfo:
    config: EngineConfig
    model_name: str
    tokenizer: Any  # None in the copy an engine process sends its front (which loads its own)
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int  # tokens the KV pool holds: one request's prompt + max_tokens at most

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated; ValueError names what is wrong. A prompt is text,
        token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict):
            prompt = _unwrap(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt: must be text or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < self.vocab_size:
            return ids  # the common case in three C loops, not one Python test per token
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        return ids

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids if the engine can serve it with params; else ValueError."""
        ids = self.encode(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                             f"context of {self.max_model_len} tokens")
        pool = self.kv_capacity_tokens
        if len(ids) + params.max_tokens > pool:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV pool's "
                             f"capacity of {pool} tokens: max_tokens may be at most {max(pool - len(ids), 0)} "
                             f"for this prompt")
        return ids


def _unwrap(prompt: dict) -> str | Sequence[int]:
    """The text or ids of a vLLM-style prompt dict."""
    keys = set(prompt)
    if keys == {"prompt"}:
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise ValueError(f"prompt: a dict prompt needs exactly one of 'prompt' or 'prompt_token_ids', got keys "
                     f"{sorted(keys)}")
