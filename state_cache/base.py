"""Contracts of the memory layer: result types and the interfaces the scheduler codes against.

Who owns what (the accounting map; every arrow is an explicit call):

    KV page    pool.alloc -> the request's (ref 1)
               -> insert(): pages [0, len(tokens) // page_size) become the tree's; a page whose
                  prefix the tree already holds is freed there (duplicate); pages past the last
                  full page stay the request's, and the request frees them
               -> evict() / flush(): the tree frees its pages
    ckpt slot  alloc_checkpoint -> the caller's, writable (save() or the forward fills it)
               -> insert(checkpoints={pos: slot}): adopted by the node ending at pos and sealed
                  (immutable), or freed there if that node already holds one
               -> evict() / flush(): the tree frees it.  A slot never passed to insert() is the
                  caller's to free.
    active     alloc_active -> exclusive to one request, written in place -> free() by the
    slot       request.  Never referenced by the tree; a hit copies a checkpoint into it.
    lock       lock(node) pins node's pages and checkpoint and its ancestors' pages until
               unlock(node) (ancestors' checkpoints stay evictable); locks nest (counted).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

if TYPE_CHECKING:
    from state_cache.admission import CheckpointAdmission
    from state_cache.config import CacheConfig
    from state_cache.kv_pool import KVPool
    from state_cache.node import Node
    from state_cache.state_pool import StatePool


class IntegrityError(RuntimeError):
    """A pool or the tree broke one of its accounting invariants."""


class Checkpoint(NamedTuple):
    """A sealed checkpoint slot holding every linear layer's state after `pos` tokens."""

    slot: int
    pos: int


class MatchResult(NamedTuple):
    """What the cache holds for a token sequence.

    kv_len:     tokens whose KV the tree holds (a multiple of page_size, <= len(tokens)).
    state_len:  usable prefix: the deepest checkpoint position on the matched path with
                state_len <= len(tokens) - 1 (a multiple of G; 0 when none).
    node:       opaque handle of the node ending at state_len (the root when 0); lock it
                before using pages or checkpoint, unlock when done. `node.end == state_len`.
    checkpoint: the checkpoint at state_len, or None when state_len == 0.
    pages:      the tree's KV pages for tokens [0, state_len), in order.
    branch_pos: the G-position at or before the point where the tokens leave a cached
                path (0 when they extend or stay on one): admit a checkpoint there.
    host_len:   with a host tier, the deeper usable prefix that `load(host_node)` would bring
                back (its KV and/or checkpoint are on the host); 0 when there is none.
    host_bytes: the bytes that load would copy from the host.
    """

    kv_len: int
    state_len: int
    node: Any
    checkpoint: Checkpoint | None
    pages: list[int]
    branch_pos: int
    host_len: int = 0
    host_node: Any = None
    host_bytes: int = 0


class InsertResult(NamedTuple):
    """Outcome of insert(): the tree now owns pages for tokens [0, node.end).

    node:  the node ending at len(tokens) // page_size * page_size (lock it to keep using them).
    pages: the tree's pages for tokens [first_page * page_size, node.end); the caller's page
           table must use these from now on (a page of the caller that duplicated one of the
           tree's has been freed). first_page is 0 unless insert() was given a `start` node.
    """

    node: Any
    pages: list[int]
    new_pages: int
    freed_pages: int
    new_checkpoints: int
    freed_checkpoints: int
    first_page: int = 0


class EvictResult(NamedTuple):
    """How much eviction freed (it may free more than asked: whole nodes go)."""

    pages: int
    checkpoints: int


class CacheStats(NamedTuple):
    """Counters since start (hits, inserts, evictions) and pool usage now, for metrics."""

    lookups: int
    lookup_tokens: int
    kv_hit_tokens: int
    state_hit_tokens: int
    flops_saved: float
    inserted_pages: int
    inserted_checkpoints: int
    evicted_pages: int
    evicted_checkpoints: int
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_locked: int
    checkpoints_total: int
    checkpoints_free: int
    checkpoints_cached: int
    checkpoints_locked: int
    active_total: int
    active_free: int
    page_bytes: int = 0
    unified: bool = False  # one budget: checkpoints are pages of the KV pool
    checkpoints_used: int = 0  # checkpoints allocated (cached, or being written by requests)
    checkpoint_bytes: int = 0  # the bytes one checkpoint takes (whole pages under the unified budget)
    host_loads: int = 0  # load() calls that brought a prefix back from the host tier
    host_hit_tokens: int = 0  # state-hit tokens that came from the host tier
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    host_evicted_pages: int = 0  # host pages dropped by host-tier eviction
    host_pages_total: int = 0
    host_pages_free: int = 0
    host_pages_cached: int = 0  # host pages holding KV
    host_checkpoints_cached: int = 0


class Candidate(NamedTuple):
    """Something the cache could evict, as a policy sees it.

    saved_flops: prefill FLOPs a future request that resumes there would recompute without it
                 (from the next checkpoint above it; 0 for KV with no checkpoint at its end);
                 nbytes: bytes evicting it frees; node: the cache's
                 opaque handle of it (for policies that know more than these numbers, such as
                 an offline reference that knows the trace).
    """

    last_access: float
    saved_flops: float
    nbytes: int
    node: Any = None


class EvictionPolicy(ABC):
    """Orders eviction candidates; the cache evicts the lowest priority first."""

    name: str

    @classmethod
    def from_config(cls, config: CacheConfig) -> EvictionPolicy:
        """The policy with its parameters from a CacheConfig (default: none)."""
        return cls()

    @abstractmethod
    def scorer(self, candidates: Sequence[Candidate]) -> Callable[[Candidate], float]:
        """A priority function fitted to one eviction round's candidates.

        It is also applied to candidates that appear during the round (a parent whose last
        child was evicted), so it must accept values outside the fitted range.
        """

    def evicted(self, priority: float) -> None:
        """The cache evicted a candidate of this priority, ranked by the last scorer (a policy
        with state, such as gdsf's aging level, updates it here; default: nothing)."""
        return None


class PrefixCache(ABC):
    """A prefix cache over token ids for hybrid models (attention KV + recurrent checkpoints).

    Contracts a caller may rely on:
      * a match ends only at a checkpoint position: `state_len` is a multiple of
        `granularity` with a checkpoint there, or 0; never more than len(tokens) - 1;
      * a locked node keeps its pages and its checkpoint, and its ancestors keep their pages;
        the checkpoints of its ancestors may be evicted (a request needs only the one it
        resumed from, which is on the node it locked);
      * insert() never copies KV: it takes ownership of the caller's pages (see the map in
        this module's docstring) and returns the page ids the caller must use;
      * a checkpoint, once inserted, is never written again; restore() copies it out bit-exact;
      * `start=` (match_prefix, insert) walks from a node the caller holds locked on the
        tokens' path and gives the same result as a walk from the root, at the cost of the
        tokens below that node only;
      * every method works without tensors (pools that only count).

    Attributes: `kv_pool` (KVPool), `state_pool` (StatePool), `page_size`, `config`
    (CacheConfig) and `admission` (the CheckpointAdmission the config selects: where
    callers should checkpoint).
    """

    kv_pool: KVPool
    state_pool: StatePool
    page_size: int
    config: CacheConfig
    admission: CheckpointAdmission

    @property
    @abstractmethod
    def granularity(self) -> int:
        """G = max(kernel chunk, page_size) (or the configured coarser grid): checkpoints
        exist only at multiples of G."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages evict() could free now (for admission)."""

    @property
    @abstractmethod
    def free_pages(self) -> int:
        """Pages alloc_pages() can hand out without evicting."""

    @property
    @abstractmethod
    def capacity_pages(self) -> int:
        """The most pages the cache can ever give (one request can never hold more)."""

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int], *, record_stats: bool = True, start: Any = None) -> MatchResult:
        """Longest cached prefix of tokens; counts a lookup in the stats when record_stats."""

    @abstractmethod
    def record_lookup(self, num_tokens: int, m: MatchResult) -> None:
        """Count one lookup of num_tokens with result m in the stats (what match_prefix does
        with record_stats; for callers that count a match only once it is used)."""

    @abstractmethod
    def continues(self, node: Any, tokens: Sequence[int]) -> bool:
        """Whether the tree holds the page of `tokens` right after `node` (a node on their path,
        None for the root): an O(page) test for "a deeper match may exist"."""

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Pin node (pages, checkpoint) and its ancestors' pages against eviction (counted:
        one unlock per lock)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Undo one lock(node); ValueError if node is not locked."""

    @abstractmethod
    def relock(self, old: Any, new: Any) -> None:
        """lock(new) then unlock(old); O(distance) when new lies below old."""

    @abstractmethod
    def insert(
        self,
        tokens: Sequence[int],
        kv_pages: Sequence[int],
        checkpoints: Mapping[int, int] | None = None,
        *,
        start: Any = None,
    ) -> InsertResult:
        """Move the KV pages of tokens (and checkpoint slots {pos: slot}) into the tree.

        tokens: ids whose KV is written in kv_pages; kv_pages[i] holds tokens
        [i * page_size, (i + 1) * page_size). Positions must be multiples of G within
        (0, len(tokens) // page_size * page_size]; ValueError naming the argument otherwise.
        """

    @abstractmethod
    def evict(self, num_pages: int = 0, num_checkpoints: int = 0) -> EvictResult:
        """Free at least that many unlocked pages and checkpoint slots under the policy.

        Evicting a node's KV evicts its checkpoint too; a checkpoint may go alone.
        Frees less only when nothing unlocked is left.
        """

    @abstractmethod
    def drop_checkpoints(self, tokens: Sequence[int], positions: Sequence[int], below: Node | None = None) -> int:
        """Free the checkpoints at these positions of tokens' cached path unless a lock is held
        on their very node (locks below it pin only its KV, which stays); returns how many
        went. For checkpoints kept only while the request that wrote them needs them.
        below: a node on that path at or past every position (found by walking up from it,
        in O(nodes between) rather than O(path))."""

    @abstractmethod
    def restore(self, checkpoint: Checkpoint, active_slot: int) -> None:
        """Copy a checkpoint into a request's active slot (every linear layer, same dtype)."""

    @abstractmethod
    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Pages for a request, evicting cached ones if needed; None if that is not enough."""

    @abstractmethod
    def alloc_checkpoint(self, keep_pages: int = 0, staged: bool = True, kind: str | None = None) -> int | None:
        """A writable checkpoint slot, evicting if needed; None if everything is locked, or
        (under one byte budget) if taking it would leave fewer than keep_pages pages
        allocatable (free or evictable): bytes promised to running requests stay theirs.
        staged: a forward will write it (it needs a staging row under the unified budget);
        False for one filled by save(). kind: the admission rule that wants it (branch, last,
        hedge, chunk, decode, interval); the checkpoint keeps it once inserted, and eviction
        weighs it by how often that kind is resumed from."""

    @property
    def host_bytes_moved(self) -> int:
        """Bytes copied between the device and the host tier since start, both ways (0 without one)."""
        return 0

    def load(self, m: MatchResult) -> bool:
        """Bring m's host-tier part (m.host_node) back to the device; True if m.host_len is now a
        device hit. A cache without a host tier has nothing to load."""
        return False

    @abstractmethod
    def flush(self) -> None:
        """Free every page and checkpoint the tree holds; RuntimeError while anything is locked."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Counters and pool usage now."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError unless the tree and both pools are consistent."""
