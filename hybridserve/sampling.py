"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, seeds)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as vLLM): logits / t would overflow fp32


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, in the OpenAI / vLLM vocabulary.

    temperature 0 (or below 1e-5) is greedy; top_k <= 0 and top_p == 1 disable those
    filters; `seed` makes a request's samples reproducible whatever it is batched with;
    `logprobs` = k returns the sampled token's logprob and the k most likely alternatives
    (0: the sampled one only).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _finite(self.temperature) and 0 <= self.temperature <= 100, "a number in [0, 100]"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "an integer >= -1 (<= 0 disables)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63), "an int >= 0"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs
                                                   <= MAX_LOGPROBS), f"an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {brief(getattr(self, name))}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {brief(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {brief(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def brief(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (error messages never echo a huge input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Sampled(NamedTuple):
    tokens: list[int]
    logprobs: list[float | None]  # of the sampled token, where asked
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row of a logits batch; per-request generators keep seeds exact.

    A row whose sampling raises fails alone: it gets its argmax token and its key lands in
    `failures` (key -> exception) until `take_failures()`; the other rows are unaffected.
    """

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.generators: dict[object, torch.Generator] = {}
        self.failures: dict[object, Exception] = {}

    def release(self, key) -> None:
        self.generators.pop(key, None)

    def take_failures(self) -> dict[object, Exception]:
        failures, self.failures = self.failures, {}
        return failures

    def _generator(self, key, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[key]

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence) -> Sampled:
        """logits [B, V] fp32; params/keys per row (keys identify requests for their generators)."""
        logits = logits.float()
        tokens = argmax_rows(logits)  # greedy rows keep this
        for i, p in enumerate(params):
            if p.greedy:
                continue
            try:
                row = filter_logits(logits[i] / p.temperature, p.top_k, p.top_p)
                probs = torch.softmax(row, -1)
                tokens[i] = torch.multinomial(probs, 1, generator=self._generator(keys[i], p.seed))[0]
            except Exception as e:  # e.g. NaN logits: this row fails, not the batch
                self.failures[keys[i]] = e
        toks = tokens.tolist()
        lps: list[float | None] = [None] * len(params)
        tops: list[list[tuple[int, float]] | None] = [None] * len(params)
        if any(p.logprobs is not None for p in params):
            logp = torch.log_softmax(logits, -1)
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    lps[i] = float(logp[i, toks[i]])
                    if p.logprobs:
                        v, ix = logp[i].topk(p.logprobs)
                        tops[i] = list(zip(ix.tolist(), v.tolist()))
        return Sampled(toks, lps, tops)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for [B, V] logits; numpy's on CPU, which picks the same index (the first
    of equal maxima, the first NaN) in a fifth of the time (64 x 4,096 fp32: 20 against 114 us)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().numpy().argmax(-1))


def filter_logits(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) all but the top_k logits and the smallest set whose mass reaches top_p;
    the most likely token is always kept (a top_p that rounds to 0 in fp32 keeps just it)."""
    if top_k > 0 and top_k < row.numel():
        kth = row.topk(top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_, idx = row.sort(descending=True)
        probs = torch.softmax(sorted_, -1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the token that crosses top_p
        drop[0] = False
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    return row


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in text of the earliest stop string that begins at or after `start - longest + 1`
    (so only newly generated text is searched), or None."""
    if not stop:
        return None
    lo = max(0, start - max(map(len, stop)) + 1)
    hits = [i for s in stop if (i := text.find(s, lo)) >= 0]
    return min(hits) if hits else None
