"""CacheConfig: how the one prefix-cache mechanism behaves (where checkpoints go, how
entries are evicted, what a node split keeps).

Engines differ in exactly these choices, so a replay of another engine's cache is a
CacheConfig, not another cache class. Every field has one default and is checked here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from state_cache.eviction import policy_names


@dataclass(frozen=True)
class CacheConfig:
    enable_prefix_cache: bool = field(default=True, metadata={
        "help": "resume requests from cached prefixes (KV + state checkpoints); off: compute every prompt "
                "in full (what is computed is still cached)"})
    eviction: str = field(default="lru", metadata={
        "help": "prefix-cache eviction policy: lru, or utility (FLOPs saved per byte, blended with recency)",
        "choices": policy_names})
    checkpoint_grid: int | None = field(default=None, metadata={
        "help": "checkpoint positions are multiples of this many tokens (a multiple of G = max(kernel chunk, "
                "page size)); unset: G"})
    checkpoint_interval: int | None = field(default=None, metadata={
        "help": "also checkpoint every N tokens (a multiple of the checkpoint grid); unset: only where the "
                "checkpoint_* rules say"})
    checkpoint_chunk_ends: bool = field(default=True, metadata={
        "help": "checkpoint the end of every prefill chunk that ends on the grid"})
    checkpoint_last_prompt: bool = field(default=True, metadata={
        "help": "checkpoint the last grid position before a prompt's final token (an identical resend "
                "resumes there)"})
    checkpoint_branch_points: bool = field(default=True, metadata={
        "help": "checkpoint the grid position where a prompt leaves a cached path (later requests branch "
                "there again)"})
    checkpoint_decode: bool = field(default=True, metadata={
        "help": "keep the last grid position reached while decoding (a conversation's next turn resumes "
                "there)"})
    split_keeps_checkpoint: bool = field(default=True, metadata={
        "help": "a radix node split by a shorter match keeps its checkpoint (off: the state is dropped, as "
                "in caches that key states by node)"})

    def __post_init__(self):
        if self.eviction not in policy_names():
            raise ValueError(f"eviction: unknown eviction policy {self.eviction!r}; known: {', '.join(policy_names())}")
        for name in ("checkpoint_grid", "checkpoint_interval"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or unset, got {value!r}")
        if self.checkpoint_interval and self.checkpoint_grid and self.checkpoint_interval % self.checkpoint_grid:
            raise ValueError(f"checkpoint_interval={self.checkpoint_interval} must be a multiple of "
                             f"checkpoint_grid={self.checkpoint_grid}")
