"""Scheduling policies: which prefill chunks and decode rows go into the next forward.

Each policy is a registered class that owns its request order (admission and prefill) and
its round planning; the scheduler calls only these methods:
  tokens          fixed token budget, one chunked request at a time, prefill first (decode
                  waits for prefill rounds unless `mixed_chunk`): SGLang's default.
  budget          one token budget shared with decode, decode first: vLLM V1's default.
  serial          decode rides along; prefill fills the round up to `target_step` seconds of
                  *predicted* time (the cost model prices serial chunk steps).
  serial+deadline serial, served earliest-deadline-first; a request whose remaining work no
                  longer fits before its deadline at the target gets a larger chunk, up to
                  `max_step` seconds per round.
Middle chunks end on multiples of G (with `aligned_cuts`, the default); only a request's last
chunk ends anywhere.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, NamedTuple, Sequence

from scheduler.cost import BatchShape, CostModel
from scheduler.request import Req

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class LinearSlo:
    """ttft_slo(n) = base + per_token * n seconds."""

    base: float = 2.0
    per_token: float = 2e-4

    def __call__(self, prompt_len: int) -> float:
        return self.base + self.per_token * prompt_len


class Pick(NamedTuple):
    req: Req
    start: int
    end: int


class Plan(NamedTuple):
    chunks: list[Pick]
    decodes: list[Req]


class SchedulingPolicy(ABC):
    """Orders requests and plans rounds. `uses_cost_model`: whether planning reads the cost
    model (an engine fits one at start-up only for such policies)."""

    name: ClassVar[str]
    uses_cost_model: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig, cost: CostModel, g: int):
        self.config, self.cost, self.g = config, cost, g

    def admission_order(self, waiting: Sequence[Req]) -> list[Req]:
        """The order in which waiting requests are considered for admission (default FIFO)."""
        return list(waiting)

    def prefill_order(self, prefills: Sequence[Req], admitted: Mapping[Req, int]) -> list[Req]:
        """The order prompt work is served in: partially prefilled first, then admission order."""
        return sorted(prefills, key=lambda r: (r.extend_end == r.cached_tokens, admitted[r]))

    @abstractmethod
    def plan(self, prefills: Sequence[Req], decodes: Sequence[Req], now: float) -> Plan:
        """The chunks and decode rows of the next round. prefills: requests with prompt work
        left, in `prefill_order`; decodes: requests ready for a decode row."""

    def scheduled(self, has_chunks: bool) -> None:  # noqa: B027 (an optional hook)
        """Told after each round is placed, whether it holds prefill chunks."""

    def most_tokens(self) -> int | None:
        """An upper bound on the tokens of any round it plans (None: none known); the engine's
        start-up warm-up forward is this large. Token policies: the budget plus every decode row."""
        return self.config.token_budget + self.config.max_running


_POLICIES: dict[str, type[SchedulingPolicy]] = {}


def register(name: str):
    """Class decorator: make a scheduling policy selectable by `name`."""

    def deco(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return list(_POLICIES)


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The policy registered as `name`; ValueError lists the known names."""
    if name not in _POLICIES:
        raise ValueError(f"policy: unknown scheduling policy {name!r}; known: {policy_names()}")
    return _POLICIES[name]


def scheduling_policy(config: SchedulerConfig, cost: CostModel, g: int) -> SchedulingPolicy:
    """The policy `config.policy` names, built for a cache grid G."""
    return policy_class(config.policy)(config, cost, g)


def _at_least_grid(name: str, tokens: int | None, g: int) -> None:
    """A round's token bound must hold one G step (the least a chunk advances); None: no bound."""
    if tokens is not None and tokens < g:
        raise ValueError(f"{name}={tokens} is below the checkpoint grid G={g}")


class _TokenPolicy(SchedulingPolicy):
    def __init__(self, config: SchedulerConfig, cost: CostModel, g: int):
        super().__init__(config, cost, g)
        _at_least_grid("token_budget", config.token_budget, g)


@register("tokens")
class TokenBudget(_TokenPolicy):
    """A fixed token budget per round, one partially prefilled prompt at a time, prefill first."""

    def __init__(self, config: SchedulerConfig, cost: CostModel, g: int):
        super().__init__(config, cost, g)
        self.decode_turns = 0  # decode-only rounds still owed (decode_steps_between_prefills)

    def plan(self, prefills: Sequence[Req], decodes: Sequence[Req], now: float) -> Plan:
        if not prefills or (self.decode_turns and decodes):  # owed decode turns wait for decode rows
            return Plan([], list(decodes))
        chunks = _fill_tokens(prefills, self.config.token_budget, self.g, one_partial=True)
        return Plan(chunks, list(decodes) if self.config.mixed_chunk else [])

    def scheduled(self, has_chunks: bool) -> None:
        self.decode_turns = self.config.decode_steps_between_prefills if has_chunks else max(0, self.decode_turns - 1)


@register("budget")
class SharedBudget(_TokenPolicy):
    """One token budget shared with decode, decode rows first."""

    def plan(self, prefills: Sequence[Req], decodes: Sequence[Req], now: float) -> Plan:
        rows = list(decodes[: self.config.token_budget])
        return Plan(_fill_tokens(prefills, self.config.token_budget - len(rows), self.g, one_partial=False), rows)


@register("serial")
class SerialBudget(SchedulingPolicy):
    """Decode rides along; prefill fills the round up to target_step predicted seconds (and
    max_round_tokens tokens, where set)."""

    uses_cost_model = True

    def __init__(self, config: SchedulerConfig, cost: CostModel, g: int):
        super().__init__(config, cost, g)
        _at_least_grid("max_round_tokens", config.max_round_tokens, g)

    def plan(self, prefills: Sequence[Req], decodes: Sequence[Req], now: float) -> Plan:
        return Plan(self._fill_time(prefills, list(decodes), now), list(decodes))

    def grow(self, r: Req, base: float, now: float) -> float | None:
        """A larger round time r needs than target_step (None: none)."""
        return None

    def longest_step(self) -> float:
        """The most predicted seconds a round may take."""
        return self.config.target_step

    def most_tokens(self) -> int | None:
        """Rounds end at longest_step() predicted seconds, which c_tok seconds a token alone would
        fill, and at max_round_tokens, except that every decode row runs and the first chunk
        advances one G step."""
        cost, cap = self.cost, self.config.max_round_tokens
        by_time = int((self.longest_step() - cost.c0) / cost.c_tok) if cost.c_tok else None
        bound = min((n for n in (by_time, cap) if n is not None), default=None)
        return None if bound is None else max(bound, self.config.max_running + self.g)

    def _fill_time(self, prefills: Sequence[Req], decodes: list[Req], now: float) -> list[Pick]:
        """Add chunks while the predicted round time stays under target and the round's tokens
        within max_round_tokens; the first request always advances by at least one G step, and
        `grow` may allow an urgent one more time (not more tokens)."""
        cost, target, cap = self.cost, self.config.target_step, self.config.max_round_tokens
        ctx = [r.prefix_len for r in decodes]
        chunks: list[Pick] = []
        room = math.inf if cap is None else cap - len(decodes)  # prefill tokens the cap leaves

        def shape(extra: Pick | None = None) -> BatchShape:
            picks = chunks + ([extra] if extra else [])
            return BatchShape([(p.start, p.end - p.start) for p in picks], ctx)

        def step_to(r: Req, start: int) -> Callable[[int], float]:
            """Predicted round time with r's chunk [start, end) added, as a function of end."""
            return lambda end: cost.step_time(shape(Pick(r, start, end)))

        for r in prefills:
            start = r.extend_end
            ends = Ends(start, r.fill_len, self.g)
            step = step_to(r, start)
            end = ends.largest(step, target, start + room)
            tau = self.grow(r, cost.step_time(shape()), now)
            if tau is not None and tau > target:
                end = ends.largest(step, tau, start + room) or end
            if end is None:
                if chunks:
                    break  # nothing more fits this round
                end = ends[0]
            chunks.append(Pick(r, start, end))
            room -= end - start
        return chunks


@register("serial+deadline")
class SerialDeadline(SerialBudget):
    """serial, earliest deadline first; a late prompt's round grows up to max_step."""

    def admission_order(self, waiting: Sequence[Req]) -> list[Req]:
        return sorted(waiting, key=_deadline)

    def prefill_order(self, prefills: Sequence[Req], admitted: Mapping[Req, int]) -> list[Req]:
        return sorted(prefills, key=_deadline)

    def grow(self, r: Req, base: float, now: float) -> float | None:
        return deadline_step(self.config.max_step, self.cost, r, base, now, self.config.target_step)

    def longest_step(self) -> float:
        return max(self.config.target_step, self.config.max_step)


def _deadline(r: Req) -> float:
    return math.inf if r.deadline is None else r.deadline


def cut(start: int, want: int, fill_len: int, g: int) -> int:
    """End of a chunk of about `want` tokens from `start`: the fill end if within reach, else
    the last multiple of G at or below start + want (at least one G step)."""
    if start + want >= fill_len:
        return fill_len
    end = (start + want) // g * g
    return end if end > start else min(start // g * g + g, fill_len)


def _fill_tokens(prefills: Sequence[Req], budget: int, g: int, one_partial: bool) -> list[Pick]:
    chunks: list[Pick] = []
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


class Ends:
    """Candidate ends of a chunk from start: the G multiples above start, then fill_len."""

    def __init__(self, start: int, fill_len: int, g: int):
        self.first, self.g, self.fill_len = start // g * g + g, g, fill_len
        self.n = max(0, math.ceil((fill_len - self.first) / g))  # G ends strictly below fill_len

    def __len__(self) -> int:
        return self.n + 1

    def last_at_most(self, end: float) -> int:
        """The index of the largest candidate end <= end (-1: none)."""
        if end >= self.fill_len:
            return len(self) - 1
        return min(self.n - 1, int((end - self.first) // self.g)) if end >= self.first else -1

    def __getitem__(self, i: int) -> int:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.first + i * self.g if i < self.n else self.fill_len

    def largest(self, step: Callable[[int], float], limit: float, upto: float = math.inf) -> int | None:
        """The largest end <= upto whose predicted step is <= limit (step grows with the end)."""
        lo, hi = -1, self.last_at_most(upto)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if step(self[mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return self[lo] if lo >= 0 else None


def deadline_step(max_step: float, cost: CostModel, r: Req, base: float, now: float,
                  target: float = 0.0) -> float:
    """The round time that lets r finish its fill by its deadline (capped at max_step).

    The prefill work left, W = c_tok * rest + c_attn * layers * (fill^2 - start^2) / 2 +
    c_serial * rest / chunk, does not depend on the cuts (under context parallelism W is that
    of one round, an upper bound: a short round at a long prefix splits its pairs about
    evenly). Rounds of length tau spend `base` on the rest of the batch and on reading r's
    prefix, and tau - base on r's work, so finishing takes W * tau / (tau - base):
    tau = base * left / (left - W) meets the deadline, less one round of slack. The slack is
    a round of the length being chosen (a fixed point, from `target`), not of max_step: a
    short deadline would otherwise lose a tenth of its time to slack and double the decode
    gaps it needs. Pricing rounds by time rather than tokens keeps the estimate right as
    attention grows with the prefix.
    """
    start, fill = r.extend_end, r.fill_len
    work = cost.prefill_work(start, fill)
    # each round r is in also reads r's cached prefix: a per-round cost, priced at the mean
    # prefix of the rounds left, like the rest of the batch
    base = (base or cost.c0) + cost.c_prefix * cost.attn_layers * (start + fill) / 2
    tau = max(target, base)
    for _ in range(4):  # converges in two or three: tau is small against the time left
        left = _deadline(r) - now - tau  # one round of slack
        if left <= work:
            return max_step  # late already: as fast as the cap allows
        tau = min(max_step, base * left / (left - work))
    return tau
