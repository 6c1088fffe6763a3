"""CacheConfig: how the one prefix-cache mechanism behaves (where checkpoints go, how
entries are evicted, what a node split keeps).

Engines differ in exactly these choices, so a replay of another engine's cache is a
CacheConfig, not another cache class. Every field has one default and is checked here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from state_cache.admission import CHUNK_ENDS, DECODE, LAST_PROMPT
from state_cache.eviction import policy_names


@dataclass(frozen=True)
class CacheConfig:
    enable_prefix_cache: bool = field(default=True, metadata={
        "help": "resume requests from cached prefixes (KV + state checkpoints); off: compute every prompt "
                "in full and take no state checkpoints"})
    eviction: str = field(default="gdsf", metadata={
        "help": "prefix-cache eviction policy: gdsf (FLOPs saved per byte on top of an aging level that rises "
                "to each evicted entry's worth), utility (FLOPs saved per byte blended with recency by "
                "--eviction-recency-weight), lru",
        "choices": policy_names})
    eviction_kind_rates: bool = field(default=True, metadata={
        "help": "weigh a checkpoint's saved FLOPs by the resumes per checkpoint written of its admission kind "
                "(branch, last, hedge, chunk, decode, interval), learned from the traffic; off: each counts once"})
    eviction_recency_weight: float = field(default=0.3, metadata={
        "help": "utility eviction: weight of recency against FLOPs saved per byte (0..1)"})
    eviction_shadowed_share: float = field(default=0.3, metadata={
        "help": "share of its FLOPs a checkpoint counts in eviction when a deeper checkpoint sits on its only "
                "continuation (it then serves only requests that stop in between, such as resends); 1: no discount"})
    evict_ahead: float = field(default=0.0, metadata={
        "help": "when an allocation must evict, free at least this share of the pool (or byte budget) at once, "
                "so a cache of many small entries is not ranked again at every allocation; 0: only what is needed"})
    checkpoint_grid: int | None = field(default=None, metadata={
        "help": "checkpoint positions are multiples of this many tokens (a multiple of G = max(kernel chunk, "
                "page size)); unset: G"})
    checkpoint_interval: int | None = field(default=None, metadata={
        "help": "also checkpoint every N tokens (a multiple of the checkpoint grid); unset: every 2048 tokens with "
                "a host tier, else only where the other checkpoint_* rules say"})
    checkpoint_chunk_ends: str = field(default="transient", metadata={
        "help": "checkpoints at the ends of prefill chunks on the grid: transient (kept while their request runs: "
                "concurrent requests with the same prefix and a retracted request resume there; dropped when it "
                "finishes), keep, none",
        "choices": CHUNK_ENDS})
    checkpoint_last_prompt: str = field(default="before-final", metadata={
        "help": "checkpoint near a prompt's end: before-final (the last grid position before its final token: an "
                "identical resend resumes there), floor (the last grid position of the prompt), none",
        "choices": LAST_PROMPT})
    checkpoint_branch_points: bool = field(default=True, metadata={
        "help": "checkpoint the grid position where a prompt leaves a cached path (later requests branch "
                "there again)"})
    checkpoint_hedge: int | None = field(default=1024, metadata={
        "help": "also checkpoint the last multiple of this many tokens (rounded up to the grid) in every prompt: "
                "a next turn that re-renders the prompt's tail still resumes there; unset: no hedge"})
    checkpoint_decode: str = field(default="rolling", metadata={
        "help": "checkpoints while decoding: rolling (keep the last multiple of --checkpoint-decode-grid reached: "
                "a conversation's next turn resumes there), every (keep each), none",
        "choices": DECODE})
    checkpoint_decode_grid: int | None = field(default=None, metadata={
        "help": "decode checkpoints sit on multiples of this many tokens (a multiple of the checkpoint grid); "
                "unset: the checkpoint grid"})
    split_keeps_checkpoint: bool = field(default=True, metadata={
        "help": "a radix node split by a shorter match keeps its checkpoint (off: the state is dropped, as "
                "in caches that key states by node)"})

    def __post_init__(self):
        if self.eviction not in policy_names():
            raise ValueError(f"eviction: unknown eviction policy {self.eviction!r}; known: {', '.join(policy_names())}")
        if not 0 <= self.evict_ahead < 1:
            raise ValueError(f"evict_ahead must be in [0, 1), got {self.evict_ahead}")
        if not 0 <= self.eviction_shadowed_share <= 1:
            raise ValueError(f"eviction_shadowed_share must be in [0, 1], got {self.eviction_shadowed_share}")
        if not 0 <= self.eviction_recency_weight <= 1:
            raise ValueError(f"eviction_recency_weight must be in [0, 1], got {self.eviction_recency_weight}")
        if self.checkpoint_chunk_ends not in CHUNK_ENDS:
            raise ValueError(f"checkpoint_chunk_ends: {self.checkpoint_chunk_ends!r} is not one of {list(CHUNK_ENDS)}")
        if self.checkpoint_last_prompt not in LAST_PROMPT:
            raise ValueError(f"checkpoint_last_prompt: {self.checkpoint_last_prompt!r} is not one of "
                             f"{list(LAST_PROMPT)}")
        if self.checkpoint_decode not in DECODE:
            raise ValueError(f"checkpoint_decode: {self.checkpoint_decode!r} is not one of {list(DECODE)}")
        for name in ("checkpoint_grid", "checkpoint_interval", "checkpoint_decode_grid", "checkpoint_hedge"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or unset, got {value!r}")
        for name in ("checkpoint_interval", "checkpoint_decode_grid"):
            value = getattr(self, name)
            if value and self.checkpoint_grid and value % self.checkpoint_grid:
                raise ValueError(f"{name}={value} must be a multiple of checkpoint_grid={self.checkpoint_grid}")
