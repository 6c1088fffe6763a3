"""Eviction policies, selectable by name, and the FLOPs model they score with.

    gdsf     GreedyDual-Size-Frequency (Cherkasova 1998): evict the lowest
             L(last use) + FLOPs saved per byte, where L, the cache's aging level, rises to
             each evicted priority; what was used since sits on a higher level. Recency and
             value in one unit: no weight to tune.
    lru      evict the least recently used first.
    utility  evict the lowest blend of (FLOPs a checkpoint saves per byte it holds) and
             recency, each scaled to [0, 1] over the round's candidates; KV with no
             checkpoint at its end saves nothing on its own and goes first.

Policies see only `Candidate`s (no tree, no tensors), so they run on trace replays too.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from state_cache.base import Candidate, EvictionPolicy

if TYPE_CHECKING:
    from state_cache.config import CacheConfig

FlopsFn = Callable[[int], float]


@dataclass(frozen=True)
class PrefillFlops:
    """Prefill FLOPs of tokens [0, pos): per_token * pos + attn_quadratic * pos**2.

    per_token covers the projections, MLPs and linear layers; attn_quadratic the causal
    attention scores (about 2 * attention layers * heads * head_dim per token pair).
    """

    per_token: float
    attn_quadratic: float = 0.0

    def __post_init__(self):
        if self.per_token < 0:
            raise ValueError(f"per_token must be >= 0, got {self.per_token}")
        if self.attn_quadratic < 0:
            raise ValueError(f"attn_quadratic must be >= 0, got {self.attn_quadratic}")

    def __call__(self, pos: int) -> float:
        return self.per_token * pos + self.attn_quadratic * pos * pos


def as_flops(flops: FlopsFn | tuple[float, float] | None) -> FlopsFn:
    """A FLOPs function from a callable, a (per_token, attn_quadratic) pair, or None (1 per token)."""
    if flops is None:
        return PrefillFlops(1.0)
    if callable(flops):
        return flops
    per_token, attn_quadratic = flops
    return PrefillFlops(per_token, attn_quadratic)


_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(name: str):
    """Class decorator: make a policy selectable by `name`."""

    def deco(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        cls.name = name
        _POLICIES[name] = cls
        return cls

    return deco


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy registered as `name`; ValueError lists the known names."""
    if name not in _POLICIES:
        raise ValueError(f"policy: unknown eviction policy {name!r}; known: {', '.join(policy_names())}")
    return _POLICIES[name]


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """The policy registered as `name`, built with kwargs; ValueError lists the known names."""
    return policy_class(name)(**kwargs)


@register("lru")
class LRUPolicy(EvictionPolicy):
    def scorer(self, candidates: Sequence[Candidate]) -> Callable[[Candidate], float]:
        return lambda c: c.last_access


@register("utility")
class UtilityPolicy(EvictionPolicy):
    """priority = (1 - recency_weight) * utility / max utility + recency_weight * recency.

    utility = saved_flops / nbytes; recency = (last_access - oldest) / (newest - oldest).
    """

    def __init__(self, recency_weight: float):
        if not 0.0 <= recency_weight <= 1.0:
            raise ValueError(f"recency_weight must be in [0, 1], got {recency_weight}")
        self.recency_weight = recency_weight

    @classmethod
    def from_config(cls, config: CacheConfig) -> UtilityPolicy:
        return cls(config.eviction_recency_weight)

    def scorer(self, candidates: Sequence[Candidate]) -> Callable[[Candidate], float]:
        top = max((_utility(c) for c in candidates), default=0.0) or 1.0
        oldest = min((c.last_access for c in candidates), default=0.0)
        span = max((c.last_access for c in candidates), default=0.0) - oldest or 1.0
        w = self.recency_weight

        def priority(c: Candidate) -> float:
            recency = min(max((c.last_access - oldest) / span, 0.0), 1.0)
            return (1 - w) * min(_utility(c) / top, 1.0) + w * recency

        return priority


def _utility(c: Candidate) -> float:
    return c.saved_flops / max(c.nbytes, 1)


@register("gdsf")
class GreedyDualPolicy(EvictionPolicy):
    """priority = L(last_access) + saved_flops / nbytes.

    L is the highest priority evicted so far, remembered as a step function of time: an entry
    is aged by the level of when it was last used, so one untouched since L rose is evicted
    before a newer one of equal worth, and one worth more per byte outlives it by that
    margin. A rise is dated at the newest last use among the round's candidates (what is used
    after it is newer), so the policy reads no clock. The last `history` level changes are
    kept; an entry used before the oldest of them is aged as if used then.
    """

    def __init__(self, history: int = 4096):
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.history = history
        self._times: list[float] = [float("-inf")]
        self._levels: list[float] = [0.0]
        self._now = float("-inf")  # the newest last use among the last round's candidates

    def level(self, t: float) -> float:
        """L as it was at time t."""
        return self._levels[bisect.bisect_right(self._times, t) - 1]

    def evicted(self, priority: float) -> None:
        now = self._now
        if priority <= self._levels[-1]:
            return
        if now <= self._times[-1]:
            self._levels[-1] = priority
        else:
            self._times.append(now)
            self._levels.append(priority)
        if len(self._times) > 2 * self.history:
            del self._times[1:-self.history], self._levels[1:-self.history]
            self._levels[0] = self._levels[1]

    def scorer(self, candidates: Sequence[Candidate]) -> Callable[[Candidate], float]:
        self._now = max((c.last_access for c in candidates), default=self._now)
        return lambda c: self.level(c.last_access) + _utility(c)


class KindRates:
    """Resumes per checkpoint written, for each admission kind of checkpoint (branch, last,
    hedge, chunk, decode, interval): how often the traffic comes back to where that rule
    put a state. Counts halve every `window` checkpoints written, so the rates follow a
    change of traffic."""

    def __init__(self, window: int = 4096):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._written: dict[str | None, float] = {}
        self._resumed: dict[str | None, float] = {}
        self._since = 0

    def written(self, kind: str | None) -> None:
        self._written[kind] = self._written.get(kind, 0.0) + 1
        self._since += 1
        if self._since >= self.window:
            self._since = 0
            for counts in (self._written, self._resumed):
                for k in counts:
                    counts[k] /= 2

    def resumed(self, kind: str | None) -> None:
        self._resumed[kind] = self._resumed.get(kind, 0.0) + 1

    def rate(self, kind: str | None) -> float:
        """(resumes + 1) / (written + 1): 1 before anything is known, then the observed rate."""
        return (self._resumed.get(kind, 0.0) + 1) / (self._written.get(kind, 0.0) + 1)

    def snapshot(self) -> dict[str, float]:
        """{kind: rate} of every kind written so far ("other" for checkpoints given no kind)."""
        return {k or "other": self.rate(k) for k in sorted(self._written, key=str)}
