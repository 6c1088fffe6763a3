"""A scheduler over a tensor-free cache, driven by the sim executor (clock = cost model)."""
from __future__ import annotations

from hybridserve.sim import SimClock, SimExecutor, simulate
from scheduler import CostModel, Req, Scheduler, SchedulerConfig
from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache

COST = CostModel(c0=1e-3, c_tok=1e-5, c_attn=1e-10, c_dec_attn=1e-9, c_serial=1e-4, c_dec=1e-4, attn_layers=2)


def make(policy="serial", pages=4096, page_size=64, active=16, checkpoints=64, cost=COST, **kw):
    """(scheduler, executor) on a counting-only cache with G = max(64, page_size)."""
    clock = SimClock()
    cache_kw = {k: kw.pop(k) for k in ("checkpoint_interval", "enable_prefix_cache", "checkpoint_hedge") if k in kw}
    cache = StateRadixCache(KVPool(pages, page_size), StatePool(active, checkpoints), {"kda": 64},
                            CacheConfig(**cache_kw))
    s = Scheduler(cache, SchedulerConfig(policy=policy, **kw), cost, clock)
    return s, SimExecutor(cost, clock)


def run(s, ex, reqs, on_round=None, **kw):
    return simulate(s, ex, reqs, on_round=on_round, **kw)


def req(rid, prompt, new=4, at=0.0):
    return Req(rid, list(prompt), new, arrival=at)


def prompt(seed: int, n: int, vocab: int = 1000) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
