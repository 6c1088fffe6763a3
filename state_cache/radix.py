"""StateRadixCache: a radix tree over token ids whose nodes own KV pages and checkpoints.

Edges are whole pages (see node.py); checkpoints sit at node ends on multiples of G.

    tokens  [0 ............ kv_len ... len(tokens))
    tree    [0 ... state_len ... kv_len)           kv_len: whole pages on a cached path
                       ^ deepest checkpoint <= len(tokens) - 1: where linear layers resume
"""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Mapping, Sequence

from state_cache.admission import granularity
from state_cache.base import (
    Candidate, CacheStats, Checkpoint, EvictionPolicy, EvictResult, InsertResult,
    IntegrityError, MatchResult, PrefixCache,
)
from state_cache.eviction import FlopsFn, as_flops, make_policy
from state_cache.kv_pool import KVPool
from state_cache.node import Node, common_pages, ids, iter_nodes, node_at, path_pages, split, walk
from state_cache.state_pool import StatePool


class StateRadixCache(PrefixCache):
    """The prefix cache of the engine and of the trace-replay benchmarks (see base.PrefixCache).

    kernel_chunks: kernel chunk of every linear-layer kind, e.g. {"kda": 64}; with the KV
    pool's page_size it fixes G (checked at start). policy: a registered name or a policy.
    flops: FLOPs of prefilling [0, pos), a callable or a (per_token, attn_quadratic) pair.
    clock: returns the time used for recency (default: a counter ticking once per call).
    """

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        kernel_chunks: Mapping[str, int],
        policy: str | EvictionPolicy = "lru",
        flops: FlopsFn | tuple[float, float] | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.page_size = kv_pool.page_size
        self._g = granularity(self.page_size, kernel_chunks)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.flops = as_flops(flops)
        self._clock = clock or itertools.count().__next__
        self.root = Node((), [], None, 0, self._clock())
        self._owned: set[int] = set()  # pages held by the tree
        self._holders: dict[int, Node] = {}  # checkpoint slot -> the node holding it
        self._locked_pages = 0
        self._locked_ckpts = 0
        self._counters = dict.fromkeys(
            ("lookups", "lookup_tokens", "kv_hit_tokens", "state_hit_tokens", "flops_saved",
             "inserted_pages", "inserted_checkpoints", "evicted_pages", "evicted_checkpoints"), 0)

    @property
    def granularity(self) -> int:
        return self._g

    @property
    def evictable_pages(self) -> int:
        """Pages the tree holds on unlocked nodes (all of them can be evicted)."""
        return len(self._owned) - self._locked_pages

    # -- lookup ---------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], *, record_stats: bool = True) -> MatchResult:
        tokens = ids(tokens)
        path, kv_len = walk(self.root, tokens, self.page_size)
        now = self._clock()
        node, held = self.root, []
        for x in path:
            x.last_access = now
            if x.end <= min(kv_len, len(tokens) - 1):
                held.extend(x.pages)
                node = x if x.checkpoint is not None else node
        last = path[-1] if path else self.root
        branch = kv_len // self._g * self._g if self._leaves_path(tokens, last, kv_len) else 0
        ckpt = Checkpoint(node.checkpoint, node.end) if node.checkpoint is not None else None
        if record_stats:
            c = self._counters
            c["lookups"] += 1
            c["lookup_tokens"] += len(tokens)
            c["kv_hit_tokens"] += kv_len
            c["state_hit_tokens"] += node.end
            c["flops_saved"] += self.flops(node.end)
        return MatchResult(kv_len, node.end, node, ckpt, held[: node.end // self.page_size], branch)

    def _leaves_path(self, tokens: tuple[int, ...], last: Node, kv_len: int) -> bool:
        """Whether tokens go on past kv_len where the tree continues differently (a branch point)."""
        tail = tokens[kv_len:kv_len + self.page_size]
        if last.end > kv_len:  # stopped inside last's edge
            off = kv_len - last.start
            return bool(tail) and last.key[off:off + len(tail)] != tail
        if len(tail) == self.page_size:  # a whole page that no child starts with
            return bool(last.children)
        return bool(tail) and bool(last.children) and all(k[:len(tail)] != tail for k in last.children)

    # -- locks ----------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError("node: it was evicted; match again")
        while node is not self.root:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
                self._locked_ckpts += node.checkpoint is not None
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("node: unlock without a matching lock")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
                self._locked_ckpts -= node.checkpoint is not None
            node = node.parent

    # -- insert ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        kv_pages: Sequence[int],
        checkpoints: Mapping[int, int] | None = None,
    ) -> InsertResult:
        ps = self.page_size
        length = len(tokens) // ps * ps
        tokens, mine = ids(tokens)[:length], list(ids(kv_pages[: length // ps]))
        checkpoints = dict(checkpoints or {})
        self._check_insert(tokens, mine, checkpoints)
        now = self._clock()
        node, pos, dups, new = self.root, 0, [], 0
        while pos < length:
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:  # the rest is new: one leaf
                child = Node(tokens[pos:], mine[pos // ps:], node, pos, now)
                node.children[child.key[:ps]] = child
                self._owned.update(child.pages)
                new = len(child.pages)
            else:
                n = common_pages(child.key, tokens, pos, ps)
                if n < len(child.key):
                    child = split(child, n, ps)
                theirs = mine[pos // ps: pos // ps + len(child.pages)]
                if theirs != child.pages:
                    dups += [m for m, t in zip(theirs, child.pages) if m != t]
            child.last_access = now
            node, pos = child, child.end
        freed = self.kv_pool.free(dups)
        added = dropped = 0
        for p, slot in sorted(checkpoints.items()):
            at = node_at(self.root, tokens, p, ps)
            if at.checkpoint is None:
                at.checkpoint = slot
                self.state_pool.seal(slot)
                self._holders[slot] = at
                self._locked_ckpts += at.lock_ref > 0
                added += 1
            elif at.checkpoint != slot:  # the tree already has this state
                self.state_pool.free(slot)
                dropped += 1
        self._counters["inserted_pages"] += new
        self._counters["inserted_checkpoints"] += added
        return InsertResult(node, path_pages(node), new, freed, added, dropped)

    def _check_insert(self, tokens: tuple[int, ...], mine: list[int], checkpoints: dict[int, int]) -> None:
        """Validate everything before the tree changes, so a bad call leaves it intact."""
        ps = self.page_size
        if len(mine) < len(tokens) // ps:
            raise ValueError(f"kv_pages: {len(mine)} pages for {len(tokens)} tokens of page_size {ps}")
        if len(set(mine)) != len(mine):
            raise ValueError("kv_pages: a page appears twice")
        path, kv_len = walk(self.root, tokens, self.page_size)
        tree = [p for x in path for p in x.pages][: kv_len // ps]
        same = len(tree) if mine[: len(tree)] == tree else 0  # the tree's own pages, from a match
        for i, p in enumerate(mine[same:], start=same):
            if i < len(tree) and tree[i] == p:
                continue
            if p in self._owned:
                raise ValueError(f"kv_pages: page {p} belongs to the tree at another position")
            if self.kv_pool.refcount(p) == 0:
                raise ValueError(f"kv_pages: page {p} is free")
        if len(set(checkpoints.values())) != len(checkpoints):
            raise ValueError("checkpoints: a slot appears twice")
        cached = {x.end: x.checkpoint for x in path if x.end <= kv_len}
        st = self.state_pool
        for p, slot in checkpoints.items():
            if not 0 < p <= len(tokens) or p % self._g:
                raise ValueError(f"checkpoints: position {p} is not a multiple of G={self._g} in (0, {len(tokens)}]")
            writable = st.is_checkpoint(slot) and st.is_allocated(slot) and not st.is_sealed(slot)
            if not writable and cached.get(p) != slot:
                raise ValueError(f"checkpoints: slot {slot} at {p} is not an allocated, writable checkpoint slot")

    # -- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int = 0, num_checkpoints: int = 0) -> EvictResult:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        pages = ckpts = 0
        if num_pages:
            pages, ckpts = self._evict_leaves(num_pages)
        if num_checkpoints > ckpts:
            ckpts += self._evict_checkpoints(num_checkpoints - ckpts)
        self._counters["evicted_pages"] += pages
        self._counters["evicted_checkpoints"] += ckpts
        return EvictResult(pages, ckpts)

    def _evict_leaves(self, num_pages: int) -> tuple[int, int]:
        """Drop unlocked leaves (KV and checkpoint) in policy order; a parent left bare joins."""
        def cand(x: Node) -> Candidate:
            has = x.checkpoint is not None
            nbytes = len(x.pages) * self.kv_pool.bytes_per_page + has * self.state_pool.bytes_per_slot
            return Candidate(x.last_access, self.flops(x.end) if has else 0.0, nbytes)

        leaves = [x for x in iter_nodes(self.root) if not x.children and x.lock_ref == 0]
        score = self.policy.scorer([cand(x) for x in leaves])
        tie = itertools.count()
        heap = [(score(cand(x)), x.last_access, next(tie), x) for x in leaves]
        heapq.heapify(heap)
        pages = ckpts = 0
        while pages < num_pages and heap:
            x = heapq.heappop(heap)[-1]
            parent = x.parent
            ckpts += self._drop_checkpoint(x)
            pages += self.kv_pool.free(x.pages)
            self._owned.difference_update(x.pages)
            del parent.children[x.key[: self.page_size]]
            x.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (score(cand(parent)), parent.last_access, next(tie), parent))
        return pages, ckpts

    def _evict_checkpoints(self, num: int) -> int:
        holders = [x for x in self._holders.values() if x.lock_ref == 0]
        cands = [Candidate(x.last_access, self.flops(x.end), self.state_pool.bytes_per_slot) for x in holders]
        score = self.policy.scorer(cands)
        order = sorted(range(len(holders)), key=lambda i: (score(cands[i]), cands[i].last_access))
        return sum(self._drop_checkpoint(holders[i]) for i in order[:num])

    def _drop_checkpoint(self, x: Node) -> int:
        if x.checkpoint is None:
            return 0
        self.state_pool.free(x.checkpoint)
        del self._holders[x.checkpoint]
        x.checkpoint = None
        return 1

    # -- slots, flush, stats, integrity ---------------------------------------------------

    def restore(self, checkpoint: Checkpoint, active_slot: int) -> None:
        holder = self._holders.get(checkpoint.slot)
        if holder is None or holder.end != checkpoint.pos:
            raise ValueError(f"checkpoint: {checkpoint} is not in the cache (evicted? lock before use)")
        self.state_pool.restore(checkpoint.slot, active_slot)

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        short = num_pages - self.kv_pool.num_free
        if short > 0:
            self.evict(num_pages=short)
        return self.kv_pool.alloc(num_pages)

    def alloc_checkpoint(self) -> int | None:
        if self.state_pool.num_free_checkpoints == 0:
            self.evict(num_checkpoints=1)
        return self.state_pool.alloc_checkpoint()

    def flush(self) -> None:
        if any(x.lock_ref for x in self.root.children.values()):
            raise RuntimeError("flush: nodes are still locked by running requests")
        for x in list(iter_nodes(self.root)):
            self._drop_checkpoint(x)
            self.kv_pool.free(x.pages)
            x.parent = None
        self.root.children.clear()
        self._owned.clear()

    def stats(self) -> CacheStats:
        kv, st = self.kv_pool, self.state_pool
        return CacheStats(
            **self._counters,
            pages_total=kv.num_pages, pages_free=kv.num_free,
            pages_cached=len(self._owned), pages_locked=self._locked_pages,
            checkpoints_total=st.num_checkpoints, checkpoints_free=st.num_free_checkpoints,
            checkpoints_cached=len(self._holders), checkpoints_locked=self._locked_ckpts,
            active_total=st.num_active, active_free=st.num_free_active,
        )

    def check_integrity(self) -> None:
        ps, seen = self.page_size, []
        ckpts = locked_pages = locked_ckpts = 0
        for x in iter_nodes(self.root):
            where = f"node [{x.start}, {x.end})"
            if not x.key or len(x.key) % ps or len(x.pages) != len(x.key) // ps:
                raise IntegrityError(f"{where}: key of {len(x.key)} tokens with {len(x.pages)} pages")
            if x.parent.children.get(x.key[:ps]) is not x or x.start != x.parent.end:
                raise IntegrityError(f"{where}: not linked under its parent")
            if x.lock_ref < sum(c.lock_ref for c in x.children.values()):
                raise IntegrityError(f"{where}: fewer locks than its children")
            if x.checkpoint is not None:
                if x.end % self._g or not self.state_pool.is_sealed(x.checkpoint):
                    raise IntegrityError(f"{where}: checkpoint slot {x.checkpoint} off grid or not sealed")
                if self._holders.get(x.checkpoint) is not x:
                    raise IntegrityError(f"{where}: checkpoint slot {x.checkpoint} missing from the holder map")
                ckpts += 1
                locked_ckpts += x.lock_ref > 0
            locked_pages += len(x.pages) if x.lock_ref else 0
            seen.extend(x.pages)
        if len(set(seen)) != len(seen) or set(seen) != self._owned:
            raise IntegrityError("tree: a page is held twice or the page set is stale")
        if any(self.kv_pool.refcount(p) < 1 for p in seen):
            raise IntegrityError("tree: holds a page that the pool has free")
        counted = (len(self._holders), self._locked_pages, self._locked_ckpts, self.state_pool.num_sealed)
        if counted != (ckpts, locked_pages, locked_ckpts, ckpts):
            raise IntegrityError(f"tree: counters {counted} != recount {(ckpts, locked_pages, locked_ckpts, ckpts)}")
        self.kv_pool.check_integrity()
        self.state_pool.check_integrity()

