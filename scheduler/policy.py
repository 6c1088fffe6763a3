"""Round planning: which prefill chunks and decode rows go into the next forward.

Four named policies share one code path (`plan_round`):
  tokens          fixed token budget, one chunked request at a time, prefill first (decode
                  waits for prefill rounds unless `mixed_chunk`): SGLang's default.
  budget          one token budget shared with decode, decode first: vLLM V1's default.
  serial          decode rides along; prefill fills the round up to `target_step` seconds of
                  *predicted* time (the cost model prices serial chunk steps).
  serial+deadline serial, served earliest-deadline-first; a request whose remaining work no
                  longer fits before its deadline at the target gets a larger chunk, up to
                  `max_step` seconds per round.
Middle chunks end on multiples of G; only a request's last chunk ends anywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from scheduler.cost import BatchShape, CostModel
from scheduler.request import Req

POLICIES = ("tokens", "budget", "serial", "serial+deadline")


@dataclass(frozen=True)
class LinearSlo:
    """ttft_slo(n) = base + per_token * n seconds."""

    base: float = 2.0
    per_token: float = 2e-4

    def __call__(self, prompt_len: int) -> float:
        return self.base + self.per_token * prompt_len


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "serial+deadline"
    token_budget: int = 2048  # tokens / budget: tokens per round
    target_step: float = 0.05  # serial*: predicted seconds per round (set from the ITL SLO)
    max_step: float = 0.25  # serial+deadline: cap when a chunk grows for a deadline
    mixed_chunk: bool = False  # tokens: let decode rows ride with the prefill chunk
    decode_steps_between_prefills: int = 0  # tokens: decode-only rounds after each prefill round
    ttft_slo: Callable[[int], float] = LinearSlo()

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"name: unknown policy {self.name!r}; known: {list(POLICIES)}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if not 0 < self.target_step <= self.max_step:
            raise ValueError(f"target_step must be in (0, max_step={self.max_step}], got {self.target_step}")
        if self.decode_steps_between_prefills < 0:
            raise ValueError(f"decode_steps_between_prefills must be >= 0, got {self.decode_steps_between_prefills}")


class Pick(NamedTuple):
    req: Req
    start: int
    end: int


class Plan(NamedTuple):
    chunks: list[Pick]
    decodes: list[Req]


def cut(start: int, want: int, fill_len: int, g: int) -> int:
    """End of a chunk of about `want` tokens from `start`: the fill end if within reach, else
    the last multiple of G at or below start + want (at least one G step)."""
    if start + want >= fill_len:
        return fill_len
    end = (start + want) // g * g
    return end if end > start else min(start // g * g + g, fill_len)


def plan_round(cfg: PolicyConfig, cost: CostModel, g: int, prefills: Sequence[Req], decodes: Sequence[Req],
               now: float, prefill_turn: bool = True) -> Plan:
    """The chunks and decode rows of the next round.

    prefills: requests with prompt work left, in the order the policy serves them (the
    caller sorts: partially prefilled first for `tokens`, by deadline for `serial+deadline`).
    decodes: requests ready for a decode row. prefill_turn: False during the decode-only
    rounds `decode_steps_between_prefills` asks for (tokens policy).
    """
    if cfg.name == "tokens":
        if not prefills or not prefill_turn:
            return Plan([], list(decodes))
        chunks = _fill_tokens(prefills, cfg.token_budget, g, one_partial=True)
        return Plan(chunks, list(decodes) if cfg.mixed_chunk else [])
    if cfg.name == "budget":
        rows = list(decodes[: cfg.token_budget])
        return Plan(_fill_tokens(prefills, cfg.token_budget - len(rows), g, one_partial=False), rows)
    return Plan(_fill_time(cfg, cost, g, prefills, list(decodes), now), list(decodes))


def _fill_tokens(prefills: Sequence[Req], budget: int, g: int, one_partial: bool) -> list[Pick]:
    chunks = []
    for r in prefills:
        if budget <= 0:
            break
        end = cut(r.extend_end, budget, r.fill_len, g)
        if end - r.extend_end > budget and chunks:  # a G step does not fit what is left
            break
        chunks.append(Pick(r, r.extend_end, end))
        budget -= end - r.extend_end
        if one_partial and end < r.fill_len:
            break
    return chunks


def _fill_time(cfg: PolicyConfig, cost: CostModel, g: int, prefills: Sequence[Req], decodes: list[Req],
               now: float) -> list[Pick]:
    """Add chunks while the predicted round time stays under target; the first request always
    advances by at least one G step, and under deadlines an urgent one may grow to max_step."""
    ctx = [r.prefix_len for r in decodes]
    chunks: list[Pick] = []

    def shape(extra: Pick | None = None) -> BatchShape:
        picks = chunks + ([extra] if extra else [])
        return BatchShape([(p.start, p.end - p.start) for p in picks], ctx)

    for r in prefills:
        start = r.extend_end
        ends = Ends(start, r.fill_len, g)
        step = lambda e: cost.step_time(shape(Pick(r, start, e)))  # noqa: E731
        end = ends.largest(step, cfg.target_step)
        if cfg.name == "serial+deadline":
            tau = deadline_step(cfg, cost, r, cost.step_time(shape()), now)
            if tau > cfg.target_step:
                end = ends.largest(step, tau) or end
        if end is None:
            if chunks:
                break  # nothing more fits this round
            end = ends[0]
        chunks.append(Pick(r, start, end))
    return chunks


class Ends(Sequence[int]):
    """Candidate ends of a chunk from start: the G multiples above start, then fill_len."""

    def __init__(self, start: int, fill_len: int, g: int):
        self.first, self.g, self.fill_len = start // g * g + g, g, fill_len
        self.n = max(0, math.ceil((fill_len - self.first) / g))  # G ends strictly below fill_len

    def __len__(self) -> int:
        return self.n + 1

    def __getitem__(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.first + i * self.g if i < self.n else self.fill_len

    def largest(self, step: Callable[[int], float], limit: float) -> int | None:
        """The largest end whose predicted step is <= limit (step grows with the end)."""
        lo, hi = -1, len(self) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step(self[mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return self[lo] if lo >= 0 else None


def deadline_step(cfg: PolicyConfig, cost: CostModel, r: Req, base: float, now: float) -> float:
    """The round time that lets r finish its fill by its deadline (capped at max_step).

    The prefill work left, W = c_tok * rest + c_attn * layers * (fill^2 - start^2) / 2 +
    c_serial * rest / chunk, does not depend on the cuts. Rounds of length tau spend `base`
    on the rest of the batch and tau - base on r, so finishing takes W * tau / (tau - base):
    tau = base * left / (left - W) meets the deadline (less one round of slack). Pricing
    rounds by time rather than tokens keeps the estimate right as attention grows with the
    prefix.
    """
    start, fill = r.extend_end, r.fill_len
    work = (cost.c_tok * (fill - start) + cost.c_attn * cost.attn_layers * (fill * fill - start * start) / 2
            + cost.c_serial * cost.serial_steps(fill - start))
    left = r.deadline - now - cfg.max_step  # one round of slack
    base = base or cost.c0
    if left <= work:
        return cfg.max_step  # late already: as fast as the cap allows
    return min(cfg.max_step, base * left / (left - work))
