"""Memory of the engine: paged attention KV, recurrent-state slots, the hybrid prefix cache."""
from state_cache.admission import CheckpointAdmission, DecodeCheckpoint, granularity
from state_cache.base import (
    CacheStats,
    Candidate,
    Checkpoint,
    EvictionPolicy,
    EvictResult,
    InsertResult,
    IntegrityError,
    MatchResult,
    PrefixCache,
)
from state_cache.config import CacheConfig
from state_cache.eviction import PrefillFlops, make_policy, policy_class, policy_names, register
from state_cache.journal import Journal, replay
from state_cache.kv_pool import KVPool, kv_bytes_per_token
from state_cache.radix import StateRadixCache
from state_cache.sizing import MemoryPlan, make_host_pool, make_pools, plan_memory
from state_cache.state_pool import StatePool, state_bytes_per_slot

__all__ = [
    "CacheConfig", "CacheStats", "Candidate", "Checkpoint", "CheckpointAdmission", "DecodeCheckpoint",
    "EvictResult", "EvictionPolicy", "InsertResult", "IntegrityError", "Journal", "KVPool", "MatchResult",
    "MemoryPlan", "PrefillFlops", "PrefixCache", "StatePool", "StateRadixCache", "granularity",
    "kv_bytes_per_token", "make_host_pool", "make_policy", "make_pools", "plan_memory", "policy_class", "policy_names",
    "register", "replay",
    "state_bytes_per_slot",
]
