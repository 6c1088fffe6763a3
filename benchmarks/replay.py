"""Replay a trace through the engine's scheduler and cache on the `sim` executor, under one
cache policy at one capacity.

Every policy is a `Replayed` setting of the one mechanism (StateRadixCache + Scheduler):
a CacheConfig, the page size and checkpoint grid its engine uses, and how its memory is
bounded (two pools split by a ratio, or one byte budget). docs/checkpoint_hit.md says what
each models and what it simplifies. Sizes are Kimi-Linear-48B-A3B's on one H200.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from benchmarks.traces import TraceRequest
from hybridserve import EngineConfig
from hybridserve.sim import SimClock, SimExecutor, simulate
from scheduler import CostModel, Req, Scheduler, SchedulerConfig
from state_cache import (
    CacheConfig,
    Candidate,
    EvictionPolicy,
    KVPool,
    PrefillFlops,
    StatePool,
    StateRadixCache,
    kv_bytes_per_token,
    state_bytes_per_slot,
)

# Kimi-Linear-48B-A3B: 7 MLA layers (latent 512 + rope 64, bf16) and 20 KDA layers (32 heads
# of 128 x 128 fp32, plus q/k/v conv tails of 3 x 4096 channels x 3 taps, bf16)
KV_LAYERS = [{"kv": (1, 576)}] * 7
STATE_LAYERS = [{"recurrent": ((32, 128, 128), torch.float32), "conv": ((3 * 4096, 3), torch.bfloat16)}] * 20
KV_BYTES = kv_bytes_per_token(KV_LAYERS, torch.bfloat16)  # 8,064 B per token
STATE_BYTES = state_bytes_per_slot(STATE_LAYERS)  # 43,417,600 B = 41.4 MiB per checkpoint
# prefill FLOPs of [0, pos): 2 x 3e9 active params per token, plus MLA scores of 7 layers at
# 2 x 32 heads x (192 + 128) FLOPs per (query, key) pair, pos^2 / 2 pairs
FLOPS = PrefillFlops(6e9, 7 * 2 * 32 * (192 + 128) / 2)
H200 = "kimi_linear_48b_h200"
GB = 10**9
EVICT_AHEAD = 1 / 128  # every policy frees at least 1/128 of its cache per eviction (replay speed)


def vllm_block(chunk: int | None = None, per_layer_state: int = STATE_BYTES // len(STATE_LAYERS),
               per_layer_kv: int = KV_BYTES // len(KV_LAYERS), kernel_align: int = 16) -> int:
    """vLLM's attention block for a hybrid (default: this model): raised until one block of one
    attention layer's KV holds one linear layer's state (`align`), and also a multiple of the
    kernel chunk (`all`, chunk given)."""
    if chunk is None:
        return kernel_align * math.ceil(per_layer_state / (kernel_align * per_layer_kv))
    unit = math.lcm(chunk, kernel_align)
    return unit * math.ceil(math.ceil(per_layer_state / per_layer_kv) / unit)


@dataclass(frozen=True)
class Replayed:
    """A cache policy as a setting of the mechanism.

    page: KV page (block) size; chunks: the kernel-chunk constraint on the grid ({} for an
    engine whose kernels resume anywhere); state_share: None for one byte budget over KV and
    checkpoints (checkpoints take whole pages of the KV pool, as in the engine), else the
    share of the capacity that becomes checkpoint slots (the rest KV pages); unbounded: pools
    that hold the whole trace (capacity ignored); staging: the rows new prefill checkpoints
    are written into per round (the engine's staging_rows; None: as many as wanted, for
    engines that write states straight into their blocks); host: bytes of a host tier.
    """

    name: str
    cache: CacheConfig
    page: int = 64
    chunks: dict = field(default_factory=lambda: {"kda": 64})
    state_share: float | None = None
    unbounded: bool = False
    offline: bool = False
    staging: int | None = None
    host: float = 0.0
    note: str = ""


OTHERS = dict(checkpoint_chunk_ends="keep", checkpoint_hedge=None,  # ours' rules the other engines lack
              eviction_shadowed_share=1.0, eviction_kind_rates=False)
STAGING = EngineConfig().staging_rows
SPLIT_SWEEP = (0.1, 0.2, 0.3, 0.5, 0.7, 0.9)  # checkpoint_share values of the static-split sweep
HOST_GB = (256, 1000)  # host tiers replayed beside the device capacity
POLICIES = {p.name: p for p in [
    Replayed("ours-unified", CacheConfig(), staging=STAGING,
             note="the engine's admission and eviction (CacheConfig()) on one byte budget (its default)"),
    Replayed("ours-unified-utility", CacheConfig(eviction="utility", eviction_kind_rates=False), staging=STAGING,
             note="the one budget under the previous eviction: FLOPs per byte blended with recency (weight 0.3)"),
    *[Replayed(f"ours-unified+host{gb}", CacheConfig(), staging=STAGING, host=gb * GB,
               note=f"the same plus a {gb} GB host tier (loads priced at the profile's host link)") for gb in HOST_GB],
    Replayed("ours-split", CacheConfig(), state_share=0.5,
             note="the same admission with the static split (checkpoint_share 0.5 of the bytes for checkpoints)"),
    *[Replayed(f"ours-split-{round(s * 100)}", CacheConfig(), state_share=s, note=f"static split at {s}")
      for s in SPLIT_SWEEP if s != 0.5],
    Replayed("sglang-no-buffer", CacheConfig(**OTHERS, checkpoint_last_prompt="none", checkpoint_branch_points=False,
                                             eviction="lru"),
             state_share=0.9 / 1.9, note="chunk ends + request end; mamba pool 0.9 x KV pool; two LRUs"),
    Replayed("sglang-extra-buffer", CacheConfig(**OTHERS, checkpoint_last_prompt="floor", checkpoint_decode_grid=256,
                                                eviction="lru"),
             state_share=0.9 / 1.9, note="one state per extend (floored to C) or the branch point; decode every 256"),
    Replayed("vllm-align", CacheConfig(**OTHERS, checkpoint_last_prompt="floor", checkpoint_decode="every",
                                       eviction="lru"),
             page=vllm_block(), chunks={}, note="block raised to hold a state; step ends + decode blocks; one LRU"),
    Replayed("vllm-all", CacheConfig(**OTHERS, checkpoint_interval=vllm_block(chunk=64), checkpoint_decode="every",
                                     eviction="lru"),
             page=vllm_block(chunk=64), note="a state for every block; one LRU"),
    Replayed("marconi", CacheConfig(checkpoint_chunk_ends="none", checkpoint_hedge=None, checkpoint_last_prompt="none",
                                    eviction="utility", eviction_recency_weight=0.5, eviction_shadowed_share=1.0,
                                    eviction_kind_rates=False),
             note="branch points + last decoded token; recency + FLOPs/byte (alpha = 1); one budget"),
    Replayed("unbounded", CacheConfig(checkpoint_interval=64), unbounded=True,
             note="infinite capacity, a checkpoint at every G: no policy can hit more"),
    Replayed("offline", CacheConfig(), offline=True, staging=STAGING,
             note="ours' admission, Belady eviction (farthest next use first) over the same bytes"),
]}


class NextUse:
    """When each cached prefix is next asked for, from the trace (the offline oracle).

    A prefix is named by a chained hash over its pages; for every request, each page-aligned
    prefix of its prompt maps to the request's arrival time.
    """

    def __init__(self, reqs: Sequence[TraceRequest], page: int, clock: Callable[[], float]):
        self.page, self.clock = page, clock
        uses: dict[int, list[float]] = {}
        for r in reqs:
            h = 0
            for i in range(page, len(r.prompt) + 1, page):
                h = hash((h, r.prompt[i - page:i]))
                uses.setdefault(h, []).append(r.arrival)
        self.uses = {h: sorted(t) for h, t in uses.items()}
        self._memo: dict[int, tuple[int, int, int, int]] = {}  # id(node) -> (start, end, first token, hash)

    def path_hash(self, node: Any, pos: int) -> int:
        """Chained hash of the path's tokens [0, pos) for pos on node's edge (a page boundary)."""
        chain = []
        x = node
        while x.parent is not None:
            chain.append(x)
            x = x.parent
        h = 0
        for y in reversed(chain):
            memo = self._memo.get(id(y))
            key = (y.start, y.end, y.key[0])
            if memo is not None and memo[:3] == key and y is not node:
                h = memo[3]
                continue
            for i in range(self.page, min(len(y.key), pos - y.start) + 1, self.page):
                h = hash((h, y.key[i - self.page:i]))
            if y is not node:
                self._memo[id(y)] = (*key, h)
        return h

    def after(self, h: int) -> float:
        """The first arrival after now that asks for prefix h (inf if none)."""
        times = self.uses.get(h, ())
        i = bisect.bisect_right(times, self.clock())
        return times[i] if i < len(times) else math.inf


class Belady(EvictionPolicy):
    """Evict what is asked for again farthest in the future (never again first). A leaf's KV is
    asked for by requests sharing its first page; a checkpoint by those sharing its prefix."""

    name = "offline"

    def __init__(self, oracle: NextUse):
        self.oracle = oracle

    def scorer(self, candidates: Sequence[Candidate]) -> Callable[[Candidate], float]:
        def priority(c: Candidate) -> float:
            x = c.node
            leaf = not x.children
            pos = x.start + self.oracle.page if leaf else x.end
            return -self.oracle.after(self.oracle.path_hash(x, pos))

        return priority


def build(policy: Replayed, capacity: float, reqs: Sequence[TraceRequest], clock: SimClock,
          max_running: int) -> StateRadixCache:
    """The cache a policy runs on at `capacity` bytes (its checkpoint slots, KV pages, budget)."""
    kv_page = KV_BYTES * policy.page
    unified = policy.state_share is None and not policy.unbounded
    if policy.unbounded:
        tokens = sum(len(r.prompt) + len(r.output) for r in reqs)
        pages, ckpts = tokens // policy.page + 2 * len(reqs), tokens // 64 + 2 * len(reqs)
    elif unified:  # ckpts: staging rows, outside the capacity like the active slots
        pages, ckpts = int(capacity // kv_page), policy.staging or 4 * max_running
    else:
        ckpts = int(capacity * policy.state_share // STATE_BYTES)
        pages = int((capacity - ckpts * STATE_BYTES) // kv_page)
    kv = KVPool(pages, policy.page, KV_LAYERS)
    states = StatePool(max_running, ckpts, STATE_LAYERS, arena=kv if unified else None)
    host = KVPool(int(policy.host // kv_page), policy.page, KV_LAYERS) if policy.host else None
    offline = Belady(NextUse(reqs, policy.page, clock)) if policy.offline else None
    config = dataclasses.replace(policy.cache, evict_ahead=EVICT_AHEAD)
    return StateRadixCache(kv, states, policy.chunks, config, flops=FLOPS, policy=offline, host=host)


def replay(reqs: Sequence[TraceRequest], policy: Replayed, capacity: float, max_running: int = 64,
           profile: str = H200) -> dict:
    """One point: the trace through Scheduler + cache on the sim executor; hit and TTFT figures."""
    cost = CostModel.load(profile)
    clock = SimClock()
    cache = build(policy, capacity, reqs, clock, max_running)
    config = SchedulerConfig(policy="serial+deadline", max_running=max_running, target_step=0.05, max_step=0.25)
    sched = Scheduler(cache, config, cost, clock)
    script = {f"r{i}": r.output for i, r in enumerate(reqs)}
    runs = [Req(f"r{i}", list(r.prompt), len(r.output), arrival=r.arrival) for i, r in enumerate(reqs)]
    fits = [r for r in runs if r.max_len <= sched.kv_capacity_tokens]  # the engine refuses the others
    simulate(sched, SimExecutor(cost, clock, token=lambda q: script[q.rid][len(q.output_ids)]), fits)
    rejected, runs = len(runs) - len(fits), fits
    st = cache.stats()
    ttft = np.array([r.first_token_at - r.arrival for r in runs])
    held = st.checkpoints_total - st.checkpoints_free
    return {
        "policy": policy.name, "capacity_bytes": capacity, "requests": len(runs), "rejected": rejected,
        "prompt_tokens": st.lookup_tokens,
        "token_hit_rate": st.state_hit_tokens / max(st.lookup_tokens, 1),
        "kv_hit_rate": st.kv_hit_tokens / max(st.lookup_tokens, 1),
        "state_hit_rate": st.state_hit_tokens / max(st.lookup_tokens, 1),
        "flops_saved": st.flops_saved,
        "flops_saved_share": st.flops_saved / max(sum(FLOPS(len(r.prompt)) for r in reqs), 1.0),
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p95_s": float(np.percentile(ttft, 95)),
        "ttft_s": ttft.tolist(),
        "checkpoint_bytes_end": st.checkpoints_used * st.checkpoint_bytes if st.unified else held * STATE_BYTES,
        "checkpoints_written": st.inserted_checkpoints,
        "checkpoints_evicted": st.evicted_checkpoints, "retractions": sched.counters["retractions"],
        "host_bytes": policy.host, "host_hit_rate": st.host_hit_tokens / max(st.lookup_tokens, 1),
        "host_loads": sched.counters["host_loads"], "host_recomputes": sched.counters["host_recomputes"],
        "bytes_to_host": st.bytes_to_host, "bytes_from_host": st.bytes_from_host,
    }
