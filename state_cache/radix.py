"""StateRadixCache: a radix tree over token ids whose nodes own KV pages and checkpoints.

Edges are whole pages (see node.py); checkpoints sit at node ends on multiples of G.

    tokens  [0 ............ kv_len ... len(tokens))
    tree    [0 ... state_len ... kv_len)           kv_len: whole pages on a cached path
                       ^ deepest checkpoint <= len(tokens) - 1: where linear layers resume
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Callable, Mapping, Sequence

from state_cache.admission import CheckpointAdmission, granularity
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
from state_cache.eviction import FlopsFn, KindRates, as_flops, policy_class
from state_cache.kv_pool import KVPool
from state_cache.node import Node, ancestors, common_pages, ids, iter_nodes, node_at, path_pages, split, walk
from state_cache.state_pool import StatePool

log = logging.getLogger(__name__)


class StateRadixCache(PrefixCache):
    """The prefix cache of the engine and of the trace-replay benchmarks (see base.PrefixCache).

    kernel_chunks: kernel chunk of every linear-layer kind, e.g. {"kda": 64}; with the KV
    pool's page_size (and config.checkpoint_grid) it fixes G (checked at start).
    config: the behaviour (checkpoint admission, eviction policy, splits); default CacheConfig().
    flops: FLOPs of prefilling [0, pos), a callable or a (per_token, attn_quadratic) pair.
    clock: returns the time used for recency (default: a counter ticking once per call).
    policy: a built EvictionPolicy instead of config.eviction's (one made from data, such as
    the offline reference of the benchmarks).
    host: a second page pool of the KV pool's layout (host memory): what device eviction
    would drop moves there instead, and `load()` brings it back (needs the unified budget).

    Memory: with a state pool whose arena is the KV pool (`StatePool(..., arena=kv_pool)`),
    KV pages and checkpoints are carved from one byte budget, the KV pool's pages, and
    eviction weighs both kinds in one policy order (`unified`). Otherwise the two pools'
    own sizes bound them separately (the static split: pages and checkpoints evicted apart).
    """

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        kernel_chunks: Mapping[str, int],
        config: CacheConfig | None = None,
        flops: FlopsFn | tuple[float, float] | None = None,
        clock: Callable[[], float] | None = None,
        policy: EvictionPolicy | None = None,
        host: KVPool | None = None,
    ):
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.page_size = kv_pool.page_size
        self.config = config = config or CacheConfig()
        self._g = granularity(self.page_size, kernel_chunks, config.checkpoint_grid)
        self.admission = CheckpointAdmission.from_config(self._g, config, host=host is not None)
        self.policy: EvictionPolicy = policy or policy_class(config.eviction).from_config(config)
        self.host_policy: EvictionPolicy = policy or policy_class(config.eviction).from_config(config)  # own state
        self.kind_rates = KindRates()
        self._slot_kind: dict[int, str | None] = {}  # allocated checkpoint slot -> its admission kind
        self.unified = state_pool.arena is not None
        if self.unified and state_pool.arena is not kv_pool:
            raise ValueError("state_pool: its arena must be this cache's KV pool")
        if host is not None and not self.unified:
            raise ValueError("host: a host tier needs the unified budget (a state pool with arena=kv_pool)")
        if host is not None and (host.page_size, host.bytes_per_page) != (kv_pool.page_size, kv_pool.bytes_per_page):
            raise ValueError("host: its pages must have the KV pool's page size and layout")
        self.host = host
        self.ckpt_bytes = state_pool.checkpoint_bytes
        self.flops = as_flops(flops)
        self._clock = clock or itertools.count().__next__
        self.root = Node((), [], None, 0, self._clock())
        self._owned: set[int] = set()  # pages held by the tree
        self._holders: dict[int, Node] = {}  # checkpoint slot -> the node holding it
        self._leaves: set[Node] = set()  # device nodes without device children (eviction candidates when unlocked)
        self._host_owned: set[int] = set()  # host pages held by the tree (KV and checkpoints)
        self._loading: set[Node] = set()  # nodes load() is bringing back: host eviction leaves them
        self._host_leaves: set[Node] = set()  # host nodes without children
        self._host_ckpts: set[Node] = set()  # nodes whose checkpoint is on the host
        self._tie = itertools.count()  # heap tie-breaker
        self._locked_pages = 0
        self._pinned_ckpts = 0  # checkpoints on pinned nodes (locked themselves, not just below)
        self._counters = dict.fromkeys(
            ("lookups", "lookup_tokens", "kv_hit_tokens", "state_hit_tokens",
             "inserted_pages", "inserted_checkpoints", "evicted_pages", "evicted_checkpoints",
             "host_loads", "host_hit_tokens", "bytes_to_host", "bytes_from_host", "host_evicted_pages"), 0)
        self._flops_saved = 0.0  # FLOPs of the state hits (a float, unlike the counters above)

    @property
    def granularity(self) -> int:
        return self._g

    @property
    def host_bytes_moved(self) -> int:
        return self._counters["bytes_to_host"] + self._counters["bytes_from_host"]

    @property
    def budget_bytes(self) -> int | None:
        """The one byte budget of KV and checkpoints (unified), else None."""
        return self.kv_pool.num_pages * self.kv_pool.bytes_per_page if self.unified else None

    @property
    def evictable_pages(self) -> int:
        """Pages evict() could free now (unified: the unlocked bytes of both kinds, in pages)."""
        unlocked = len(self._owned) - self._locked_pages
        if self.unified:
            unlocked += (len(self._holders) - self._pinned_ckpts) * self.state_pool.pages_per_checkpoint
        return unlocked

    @property
    def free_pages(self) -> int:
        return self.kv_pool.num_free

    @property
    def capacity_pages(self) -> int:
        return self.kv_pool.num_pages

    def _ahead_pages(self) -> int:
        return math.ceil(self.config.evict_ahead * self.kv_pool.num_pages)

    # -- lookup ---------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], *, record_stats: bool = True, start: Node | None = None
                     ) -> MatchResult:
        """See PrefixCache.match_prefix. `start`: a node on tokens' path that the caller holds
        locked (e.g. the node its last insert returned); the walk begins there, so the cost is
        that of the tokens below it, and the result is the same as without it."""
        tokens = ids(tokens)
        base = self._start(start, tokens)
        path, full_len = walk(base, tokens, self.page_size)
        now = self._clock()
        for x in path:
            x.last_access = now
        device, kv_len = _on_device(base, path, full_len)
        limit = min(kv_len, len(tokens) - 1)
        node = next((x for x in reversed(device) if x.end <= limit and x.checkpoint is not None), None)
        if node is None:  # nothing deeper than start: the deepest checkpoint at or above it
            node = next((x for x in ancestors(base) if x.end <= limit and x.checkpoint is not None), self.root)
        last = path[-1] if path else base
        branch = full_len // self._g * self._g if self._leaves_path(tokens, last, full_len) else 0
        ckpt = Checkpoint(node.checkpoint, node.end) if node.checkpoint is not None else None
        deeper = min(full_len, len(tokens) - 1)
        far = next((x for x in reversed(path) if node.end < x.end <= deeper and x.has_checkpoint), None)
        host_len, host_bytes = 0, 0
        if far is not None:  # what loading host entries would add
            host_len = far.end
            host_bytes = sum(len(x.pages) for x in path[len(device):] if x.end <= far.end) * self.kv_pool.bytes_per_page
            host_bytes += self.ckpt_bytes if far.checkpoint is None else 0
        result = MatchResult(kv_len, node.end, node, ckpt, path_pages(node), branch, host_len, far, host_bytes)
        if record_stats:
            self.record_lookup(len(tokens), result)
        return result

    def record_lookup(self, num_tokens: int, m: MatchResult) -> None:
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += num_tokens
        c["kv_hit_tokens"] += m.kv_len
        c["state_hit_tokens"] += m.state_len
        self._flops_saved += self.flops(m.state_len)
        m.node.resumed_at = self._clock()
        if m.state_len:
            self.kind_rates.resumed(m.node.kind)

    def continues(self, node: Node | None, tokens: Sequence[int]) -> bool:
        node = node or self.root
        nxt = ids(tokens[node.end: node.end + self.page_size])
        return len(nxt) == self.page_size and nxt in node.children

    def _start(self, start: Node | None, tokens: tuple[int, ...]) -> Node:
        if start is None or start is self.root:
            return self.root
        if start.parent is None or start.lock_ref == 0:
            raise ValueError("start: pass a node the caller holds locked (this one is evicted or unlocked)")
        if tokens[start.start:start.end] != start.key:
            raise ValueError(f"start: node [{start.start}, {start.end}) is not on the path of these tokens")
        return start

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
        for x in ancestors(node):
            if x.lock_ref == 0:
                self._locked_pages += len(x.pages)
            x.lock_ref += 1
        self._pin(node, 1)

    def unlock(self, node: Node) -> None:
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("node: unlock without a matching lock")
        for x in ancestors(node):
            x.lock_ref -= 1
            if x.lock_ref == 0:
                self._locked_pages -= len(x.pages)
        self._pin(node, -1)

    def _pin(self, node: Node, delta: int) -> None:
        """A lock on node itself: its checkpoint is pinned while node.pins > 0."""
        if node is self.root:
            return
        before = node.pins > 0
        node.pins += delta
        if node.checkpoint is not None and before != (node.pins > 0):
            self._pinned_ckpts += delta

    def relock(self, old: Node, new: Node) -> None:
        """lock(new) then unlock(old), in O(distance) when new lies below old (a request moving
        its lock down its own path chunk after chunk)."""
        x, steps = new, []
        while x is not old and x.parent is not None:
            steps.append(x)
            x = x.parent
        if x is not old:  # not below old
            self.lock(new)
            self.unlock(old)
            return
        for y in steps:
            if y.lock_ref == 0:
                self._locked_pages += len(y.pages)
            y.lock_ref += 1
        self._pin(new, 1)
        self._pin(old, -1)

    # -- insert ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        kv_pages: Sequence[int],
        checkpoints: Mapping[int, int] | None = None,
        *,
        start: Node | None = None,
    ) -> InsertResult:
        """See PrefixCache.insert. `start`: a locked node on tokens' path whose pages the
        caller's page table already holds (as after a previous insert); the tree is walked from
        there, so a long request stashing chunk after chunk pays for its new pages only."""
        ps = self.page_size
        length = len(tokens) // ps * ps
        tokens, mine = ids(tokens)[:length], list(ids(kv_pages[: length // ps]))
        checkpoints = dict(checkpoints or {})
        base = self._start(start, tokens)
        if base.end > length:
            raise ValueError(f"start: node ends at {base.end}, past the {length} tokens inserted")
        self._check_insert(tokens, mine, checkpoints, base)
        now = self._clock()
        node, pos, dups, new, got = base, base.end, [], 0, []
        while pos < length:
            child = node.children.get(tokens[pos:pos + ps])
            if child is None:  # the rest is new: one leaf
                child = Node(tokens[pos:], mine[pos // ps:], node, pos, now)
                node.children[child.key[:ps]] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self._owned.update(child.pages)
                new = len(child.pages)
            else:
                n = common_pages(child.key, tokens, pos, ps)
                if n < len(child.key):
                    child = self._split(child, n)
                theirs = mine[pos // ps: pos // ps + len(child.pages)]
                if child.host:  # recomputed: the caller's device pages replace the host copy
                    self._to_device(child, theirs)
                elif theirs != child.pages:
                    dups += [m for m, t in zip(theirs, child.pages) if m != t]
            child.last_access = now
            got += child.pages
            node, pos = child, child.end
        freed = self.kv_pool.free(dups)
        added = dropped = 0
        for p, slot in sorted(checkpoints.items()):
            at = self._node_at(base if p >= base.end else self.root, tokens, p)
            if at.checkpoint is None:
                self._free_host_ckpt(at)  # the fresh state supersedes a copy on the host
                at.checkpoint, at.resumed_at, at.kind = slot, now, self._slot_kind.pop(slot, None)
                self.kind_rates.written(at.kind)
                self.state_pool.seal(slot)
                self._holders[slot] = at
                self._pinned_ckpts += at.pins > 0
                added += 1
            elif at.checkpoint != slot:  # the tree already has this state
                self._slot_kind.pop(slot, None)
                self.state_pool.free(slot)
                dropped += 1
        self._counters["inserted_pages"] += new
        self._counters["inserted_checkpoints"] += added
        return InsertResult(node, got, new, freed, added, dropped, base.end // ps)

    def _split(self, child: Node, n: int) -> Node:
        """split() under the config: without split_keeps_checkpoint the lower part loses its
        checkpoint (unless a request holds that node)."""
        upper = split(child, n, self.page_size)
        if not self.config.split_keeps_checkpoint and child.pins == 0:
            self._counters["evicted_checkpoints"] += self._drop_checkpoint(child)
            self._free_host_ckpt(child)
        return upper

    def _node_at(self, root: Node, tokens: tuple[int, ...], pos: int) -> Node:
        """The node ending at pos on the cached path of tokens, splitting an edge if needed."""
        node = node_at(root, tokens, pos, self.page_size)
        return self._split(node, pos - node.start) if node.end > pos else node

    def _check_insert(self, tokens: tuple[int, ...], mine: list[int], checkpoints: dict[int, int],
                      base: Node) -> None:
        """Validate everything before the tree changes, so a bad call leaves it intact."""
        ps = self.page_size
        if len(mine) < len(tokens) // ps:
            raise ValueError(f"kv_pages: {len(mine)} pages for {len(tokens)} tokens of page_size {ps}")
        if len(set(mine)) != len(mine):
            raise ValueError("kv_pages: a page appears twice")
        below = base.end // ps
        if base is not self.root and mine[below - 1] != base.pages[-1]:
            raise ValueError(f"kv_pages: page {below - 1} is not the tree's page at the end of start")
        device, kv_len = _on_device(base, *walk(base, tokens, self.page_size))  # host pages: another id space
        tree = [p for x in device for p in x.pages][: (kv_len - base.end) // ps]
        mine = mine[below:]  # below start: the tree's pages (checked at the boundary)
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
        cached = {x.end: x.checkpoint for x in device if x.end <= kv_len}
        if any(p <= base.end for p in checkpoints):  # positions at or above start: climb once
            cached.update((x.end, x.checkpoint) for x in ancestors(base))
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
        if self.unified:  # one budget: the pages of what was asked, in one policy order
            pages, ckpts = self._evict_unified(num_pages + num_checkpoints * self.state_pool.pages_per_checkpoint)
        else:
            if num_pages:
                pages, ckpts = self._evict_leaves(num_pages)
            if num_checkpoints > ckpts:
                ckpts += self._evict_checkpoints(num_checkpoints - ckpts)
        return self._evicted(pages, ckpts)

    def _evicted(self, pages: int, ckpts: int) -> EvictResult:
        self._counters["evicted_pages"] += pages
        self._counters["evicted_checkpoints"] += ckpts
        log.debug("evicted %d pages and %d checkpoints", pages, ckpts)
        return EvictResult(pages, ckpts)

    def _leaf(self, x: Node) -> Candidate:
        """x as an eviction candidate of its tier: its pages and its checkpoint there go together."""
        has = (x.host_ckpt if x.host else x.checkpoint) is not None
        nbytes = len(x.pages) * self.kv_pool.bytes_per_page + has * self.ckpt_bytes
        return Candidate(x.last_access, self._saved(x) if has else 0.0, nbytes, x)

    def _state(self, x: Node) -> Candidate:
        """x's checkpoint alone as an eviction candidate (the node keeps its KV). Its recency is
        when a request last resumed from it: lookups that pass through to a deeper checkpoint
        use the node's KV, not its state."""
        return Candidate(x.resumed_at, self._saved(x), self.ckpt_bytes, x)

    def _saved(self, x: Node) -> float:
        """What losing x's checkpoint costs a request that would resume there: the FLOPs
        between it and the next checkpoint above it, where that request resumes instead."""
        above = next((y.end for y in ancestors(x.parent) if y.has_checkpoint), 0) if x.parent else 0
        saved = self.flops(x.end) - self.flops(above)
        if self.config.eviction_kind_rates:
            saved *= self.kind_rates.rate(x.kind)
        share = self.config.eviction_shadowed_share
        return saved * share if share < 1 and self._shadowed(x) else saved

    @staticmethod
    def _shadowed(x: Node) -> bool:
        """Whether x's only continuation in the tree holds a deeper checkpoint before any branch:
        every cached request through x went on past it, so x serves only a request that stops
        between the two (a resend of a shorter prompt)."""
        while len(x.children) == 1:
            x = next(iter(x.children.values()))
            if x.has_checkpoint:
                return True
        return False

    def _ranked(self, cands: list[tuple[Candidate, bool]], policy: EvictionPolicy | None = None
                ) -> tuple[list, Callable[[Candidate], float]]:
        """A heap of (priority, recency, tie, is_leaf, candidate) under the policy (default: the
        device tier's), and its scorer."""
        score = (policy or self.policy).scorer([c for c, _ in cands])
        heap = [(score(c), c.last_access, next(self._tie), leaf, c) for c, leaf in cands]
        heapq.heapify(heap)
        return heap, score

    def _evict_leaves(self, num_pages: int) -> tuple[int, int]:
        """Drop unlocked leaves (KV and checkpoint) in policy order; a parent left bare joins."""
        heap, score = self._ranked([(self._leaf(x), True) for x in self._leaves if x.lock_ref == 0])
        pages = ckpts = 0
        while pages < num_pages and heap:
            priority, *_, cand = heapq.heappop(heap)
            self.policy.evicted(priority)
            x = cand.node
            p, c, parent = self._drop_leaf(x)
            pages, ckpts = pages + p, ckpts + c
            if parent is not None:
                nxt = self._leaf(parent)
                heapq.heappush(heap, (score(nxt), parent.last_access, next(self._tie), True, nxt))
        return pages, ckpts

    def _evict_checkpoints(self, num: int) -> int:
        """Drop unlocked checkpoints in policy order, then, if that is not enough, those above
        a locked node (kept while they can be: a request running below may share them)."""
        dropped = 0
        for tier in self._checkpoint_tiers(inner_only=False):
            dropped += self._evict_checkpoints_among(tier, num - dropped)
        return dropped

    def _evict_checkpoints_among(self, nodes: list[Node], num: int) -> int:
        cands = [self._state(x) for x in nodes]
        score = self.policy.scorer(cands)
        order = sorted(range(len(nodes)), key=lambda i: (score(cands[i]), cands[i].last_access))
        dropped = 0
        for i in order[:max(num, 0)]:
            if self._evict_checkpoint(nodes[i]):
                dropped += 1
                self.policy.evicted(score(cands[i]))
        return dropped

    def _checkpoint_tiers(self, inner_only: bool) -> tuple[list[Node], list[Node]]:
        """Device checkpoints that may be evicted: first the unlocked ones (inner_only: not on a
        device leaf, which goes as a whole), then those locked only from below (no request holds
        their own node; see PrefixCache.lock)."""
        free = [x for x in self._holders.values() if x.lock_ref == 0 and not (inner_only and x in self._leaves)]
        above = [x for x in self._holders.values() if x.lock_ref > 0 and x.pins == 0]
        return free, above

    def _evict_unified(self, num_pages: int) -> tuple[int, int]:
        """One budget: free at least num_pages device pages, evicting unlocked device leaves (KV +
        checkpoint) and lone checkpoints of inner nodes in one policy order; with a host tier
        they move there instead of being dropped. Returns (KV pages, checkpoints) evicted."""
        kv, ppc = self.kv_pool, self.state_pool.pages_per_checkpoint
        inner, above = self._checkpoint_tiers(inner_only=True)
        heap, score = self._ranked([(self._leaf(x), True) for x in self._leaves if x.lock_ref == 0]
                                   + [(self._state(x), False) for x in inner])
        goal, pages, ckpts = kv.num_free + num_pages, 0, 0
        while kv.num_free < goal and heap:
            priority, _, _, leaf, c = heapq.heappop(heap)
            x = c.node
            if not leaf:  # a lone checkpoint (gone already if its node went as a leaf)
                if self._evict_checkpoint(x):
                    ckpts += 1
                    self.policy.evicted(priority)
                continue
            if x.parent is None or x.host or x not in self._leaves:
                continue  # evicted or moved meanwhile
            self.policy.evicted(priority)
            p, k, parent = self._drop_leaf(x)
            pages, ckpts = pages + p, ckpts + k
            if parent is not None:
                nxt = self._leaf(parent)
                heapq.heappush(heap, (score(nxt), parent.last_access, next(self._tie), True, nxt))
        short = goal - kv.num_free
        if short > 0 and above:  # last resort: checkpoints above a running request
            ckpts += self._evict_checkpoints_among(above, -(-short // ppc))
        return pages, ckpts

    def _drop_leaf(self, x: Node) -> tuple[int, int, Node | None]:
        """Evict device leaf x (its pages and checkpoint): to the host tier if there is one and it
        has room, else dropped with whatever of its subtree is on the host. Returns the KV pages
        and checkpoints it took off the device, and its parent if that became an unlocked leaf."""
        parent = x.parent
        assert parent is not None  # callers pass nodes of the tree
        pages, ckpts = len(x.pages), int(x.checkpoint is not None)
        if not self._demote(x):
            self._discard(x)
        if parent is not self.root and not any(not c.host for c in parent.children.values()):
            self._leaves.add(parent)
        bare = parent is not self.root and parent in self._leaves and parent.lock_ref == 0
        return pages, ckpts, parent if bare else None

    def _discard(self, x: Node) -> None:
        """Remove x and everything below it from the tree, freeing both tiers."""
        parent = x.parent
        assert parent is not None
        del parent.children[x.key[: self.page_size]]
        for y in [x, *iter_nodes(x)]:
            self._drop_checkpoint(y)
            self._free_host_ckpt(y)
            if y.host:
                self.host.free(y.pages)  # type: ignore[union-attr]
                self._host_owned.difference_update(y.pages)
                self._counters["host_evicted_pages"] += len(y.pages)
            else:
                self.kv_pool.free(y.pages)
                self._owned.difference_update(y.pages)
            self._leaves.discard(y)
            self._host_leaves.discard(y)
            y.parent = None
        if parent.host and not parent.children:
            self._host_leaves.add(parent)

    # -- host tier ------------------------------------------------------------------------

    def _copy(self, src: KVPool, src_pages: Sequence[int], dst: KVPool, dst_pages: Sequence[int]) -> None:
        """Page contents from one pool to another (both tiers share one page layout)."""
        nbytes = len(src_pages) * self.kv_pool.bytes_per_page
        self._counters["bytes_to_host" if dst is self.host else "bytes_from_host"] += nbytes
        src.copy_pages(src_pages, dst, dst_pages)

    def _host_alloc(self, n: int) -> list[int] | None:
        """n host pages, evicting host entries in policy order if short; None if they do not fit."""
        host = self.host
        if host is None or n > host.num_pages:
            return None
        short = n - host.num_free
        if short > 0:
            self._evict_host(max(short, math.ceil(self.config.evict_ahead * host.num_pages)))
        return host.alloc(n)

    def _demote(self, x: Node) -> bool:
        """Move device leaf x's pages and checkpoint to the host tier; False if there is none or
        it has no room."""
        ckpt = x.checkpoint
        hp = self._host_alloc(len(x.pages) + (self.state_pool.pages_per_checkpoint if ckpt is not None else 0))
        if hp is None:
            return False
        kv_hp = hp[:len(x.pages)]
        self._copy(self.kv_pool, x.pages, self.host, kv_hp)  # type: ignore[arg-type]
        self.kv_pool.free(x.pages)
        self._owned.difference_update(x.pages)
        x.pages, x.host = kv_hp, True
        self._host_owned.update(kv_hp)
        self._leaves.discard(x)
        if not x.children:
            self._host_leaves.add(x)
        if ckpt is not None:
            self._checkpoint_to_host(x, hp[len(kv_hp):])
        return True

    def _checkpoint_to_host(self, x: Node, hp: list[int]) -> None:
        """x's device checkpoint into host pages hp (freshly allocated), the device slot freed."""
        self._host_owned.update(hp)
        self._copy(self.kv_pool, self.state_pool.pages_of(x.checkpoint), self.host, hp)  # type: ignore[arg-type]
        self._drop_checkpoint(x)
        x.host_ckpt = hp
        self._host_ckpts.add(x)

    def _evict_checkpoint(self, x: Node) -> int:
        """Evict x's device checkpoint alone: to the host tier when it has room, else dropped."""
        if x.checkpoint is None:
            return 0
        if self.host is not None and x.host_ckpt is None:
            hp = self._host_alloc(self.state_pool.pages_per_checkpoint)
            if hp is not None:
                self._checkpoint_to_host(x, hp)
                return 1
        return self._drop_checkpoint(x)

    def _free_host_ckpt(self, x: Node) -> None:
        if x.host_ckpt is not None:
            self.host.free(x.host_ckpt)  # type: ignore[union-attr]
            self._host_owned.difference_update(x.host_ckpt)
            self._host_ckpts.discard(x)
            x.host_ckpt = None

    def _evict_host(self, num_pages: int) -> None:
        """Free at least num_pages host pages: host leaves (KV + checkpoint) and lone host
        checkpoints in policy order (never what load() is bringing back)."""
        host = self.host
        assert host is not None
        heap, score = self._ranked(
            [(self._leaf(x), True) for x in self._host_leaves if x not in self._loading]
            + [(self._state(x), False) for x in self._host_ckpts if x not in self._host_leaves
               and x not in self._loading], self.host_policy)
        goal = host.num_free + num_pages
        while host.num_free < goal and heap:
            priority, _, _, leaf, c = heapq.heappop(heap)
            x = c.node
            if not leaf:
                self._free_host_ckpt(x)
                self.host_policy.evicted(priority)
            elif x.parent is not None and x in self._host_leaves:
                self.host_policy.evicted(priority)
                parent = x.parent
                self._discard(x)
                if parent in self._host_leaves and parent not in self._loading:
                    nxt = self._leaf(parent)
                    heapq.heappush(heap, (score(nxt), parent.last_access, next(self._tie), True, nxt))

    def _to_device(self, x: Node, pages: list[int]) -> None:
        """Host node x takes these device pages (holding its KV) and leaves the host tier."""
        self.host.free(x.pages)  # type: ignore[union-attr]
        self._host_owned.difference_update(x.pages)
        self._host_leaves.discard(x)
        x.pages, x.host = list(pages), False
        self._owned.update(x.pages)
        assert x.parent is not None
        self._leaves.discard(x.parent)
        if not any(not c.host for c in x.children.values()):
            self._leaves.add(x)

    def load(self, m: MatchResult) -> bool:
        """Copy what m found on the host tier (m.host_node's KV path and checkpoint) back into
        device pages, evicting under the budget as usual; True if m.host_len is now a device
        hit (match again to use it), False if the device had no room (what was copied stays)."""
        node = m.host_node
        if node is None or node.parent is None:
            return False
        path = list(reversed(list(ancestors(node))))
        held = next((x for x in reversed(path) if not x.host), self.root)
        self.lock(held)
        self._loading.update(path)
        try:
            for x in path:
                if x.host:
                    pages = self.alloc_pages(len(x.pages))
                    if pages is None:
                        return False
                    self._copy(self.host, x.pages, self.kv_pool, pages)  # type: ignore[arg-type]
                    self._to_device(x, pages)
                    self.relock(held, x)
                    held = x
            if node.checkpoint is None:
                slot = self._alloc_checkpoint(0, staged=False)  # for a node that keeps its kind
                if slot is None:
                    return False
                self._copy(self.host, node.host_ckpt, self.kv_pool, self.state_pool.pages_of(slot))  # type: ignore
                self._free_host_ckpt(node)
                node.checkpoint = slot
                self.state_pool.seal(slot)
                self._holders[slot] = node
                self._pinned_ckpts += node.pins > 0
            self._counters["host_loads"] += 1
            self._counters["host_hit_tokens"] += node.end - m.state_len
            return True
        finally:
            self._loading.difference_update(path)
            self.unlock(held)

    def drop_checkpoints(self, tokens: Sequence[int], positions: Sequence[int], below: Node | None = None) -> int:
        dropped = 0
        for p in positions:
            x = self._ending_at(tokens, p, below)
            if x is None or not x.has_checkpoint:
                continue
            if x.pins == 0:  # else a request holds this very node: it may restore from it
                dropped += self._drop_checkpoint(x) or x.host_ckpt is not None
                self._free_host_ckpt(x)
        self._counters["evicted_checkpoints"] += dropped
        return dropped

    def _ending_at(self, tokens: Sequence[int], pos: int, below: Node | None) -> Node | None:
        """The node of tokens' cached path that ends at pos, if any (no split)."""
        if below is not None and below.parent is not None and below.end >= pos:
            x: Node | None = below
            while x is not None and x is not self.root and x.end > pos:
                x = x.parent
            return x if x is not None and x is not self.root and x.end == pos else None
        path, _ = walk(self.root, ids(tokens)[:pos], self.page_size)
        return path[-1] if path and path[-1].end == pos else None

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
            self.evict(num_pages=max(short, self._ahead_pages()))
        return self.kv_pool.alloc(num_pages)

    def alloc_checkpoint(self, keep_pages: int = 0, staged: bool = True, kind: str | None = None) -> int | None:
        slot = self._alloc_checkpoint(keep_pages, staged)
        if slot is not None:
            self._slot_kind[slot] = kind
        return slot

    def _alloc_checkpoint(self, keep_pages: int, staged: bool) -> int | None:
        st = self.state_pool
        if not self.unified:
            if st.num_free_checkpoints == 0:
                self.evict(num_checkpoints=max(1, math.ceil(self.config.evict_ahead * st.num_checkpoints)))
            return st.alloc_checkpoint()
        need = st.pages_per_checkpoint
        if self.free_pages + self.evictable_pages - need < keep_pages:
            return None  # the bytes are promised to running requests' pages
        short = need - self.kv_pool.num_free
        if short > 0:
            self._evicted(*self._evict_unified(max(short, self._ahead_pages())))
        return st.alloc_checkpoint(staged)

    def flush(self) -> None:
        if any(x.lock_ref for x in self.root.children.values()):
            raise RuntimeError("flush: nodes are still locked by running requests")
        for x in list(self.root.children.values()):
            self._discard(x)
        self._leaves.clear()

    def stats(self) -> CacheStats:
        kv, st, host = self.kv_pool, self.state_pool, self.host
        ppc = st.pages_per_checkpoint  # 0 unless unified: checkpoints are pages of the KV pool
        ckpt_total = kv.num_pages // ppc if ppc else st.num_checkpoints
        return CacheStats(
            **{k: v for k, v in self._counters.items() if k in CacheStats._fields}, flops_saved=self._flops_saved,
            pages_total=kv.num_pages, pages_free=kv.num_free,
            pages_cached=len(self._owned) + len(self._holders) * ppc, pages_locked=self._locked_pages,
            checkpoints_total=ckpt_total, checkpoints_free=ckpt_total - st.num_used_checkpoints,
            checkpoints_cached=len(self._holders), checkpoints_locked=self._pinned_ckpts,
            active_total=st.num_active, active_free=st.num_free_active,
            page_bytes=kv.bytes_per_page, checkpoint_bytes=self.ckpt_bytes, unified=self.unified,
            checkpoints_used=st.num_used_checkpoints,
            host_pages_total=host.num_pages if host else 0, host_pages_free=host.num_free if host else 0,
            host_pages_cached=len(self._host_owned) - self.state_pool.pages_per_checkpoint * len(self._host_ckpts),
            host_checkpoints_cached=len(self._host_ckpts),
        )

    def check_integrity(self) -> None:
        ps, seen, host_seen = self.page_size, list[int](), list[int]()
        ckpts = locked_pages = locked_ckpts = 0
        for x in iter_nodes(self.root):
            where = f"node [{x.start}, {x.end})"
            if not x.key or len(x.key) % ps or len(x.pages) != len(x.key) // ps:
                raise IntegrityError(f"{where}: key of {len(x.key)} tokens with {len(x.pages)} pages")
            if x.parent is None or x.parent.children.get(x.key[:ps]) is not x or x.start != x.parent.end:
                raise IntegrityError(f"{where}: not linked under its parent")
            if x.lock_ref - sum(c.lock_ref for c in x.children.values()) != x.pins:
                raise IntegrityError(f"{where}: {x.lock_ref} locks, {x.pins} on it, the rest not below it")
            if x.host and (x.lock_ref or x.checkpoint is not None or self.host is None):
                raise IntegrityError(f"{where}: on the host but locked or holding a device checkpoint")
            if not x.host and x.parent.host:
                raise IntegrityError(f"{where}: on the device below a node on the host")
            if x.checkpoint is not None:
                if x.end % self._g or not self.state_pool.is_sealed(x.checkpoint):
                    raise IntegrityError(f"{where}: checkpoint slot {x.checkpoint} off grid or not sealed")
                if self._holders.get(x.checkpoint) is not x or x.host_ckpt is not None:
                    raise IntegrityError(f"{where}: checkpoint slot {x.checkpoint} missing from the holder map, "
                                         "or held in both tiers")
                ckpts += 1
                locked_ckpts += x.pins > 0
            if x.host_ckpt is not None:
                if x.end % self._g or x not in self._host_ckpts:
                    raise IntegrityError(f"{where}: host checkpoint off grid or not in the host checkpoint set")
                host_seen.extend(x.host_ckpt)
            locked_pages += len(x.pages) if x.lock_ref else 0
            (host_seen if x.host else seen).extend(x.pages)
        if len(set(seen)) != len(seen) or set(seen) != self._owned:
            raise IntegrityError("tree: a page is held twice or the page set is stale")
        if len(set(host_seen)) != len(host_seen) or set(host_seen) != self._host_owned:
            raise IntegrityError("tree: a host page is held twice or the host page set is stale")
        nodes = list(iter_nodes(self.root))
        if self._leaves != {x for x in nodes if not x.host and all(c.host for c in x.children.values())}:
            raise IntegrityError("tree: the leaf set is stale")
        if self._host_leaves != {x for x in nodes if x.host and not x.children} or \
                self._host_ckpts != {x for x in nodes if x.host_ckpt is not None}:
            raise IntegrityError("tree: the host leaf or host checkpoint set is stale")
        if any(self.kv_pool.refcount(p) < 1 for p in seen):
            raise IntegrityError("tree: holds a page that the pool has free")
        if self.host is not None:
            if any(self.host.refcount(p) != 1 for p in host_seen) or self.host.num_used != len(host_seen):
                raise IntegrityError("host tier: a page is shared, free, or held by nobody")
            self.host.check_integrity()
        counted = (len(self._holders), self._locked_pages, self._pinned_ckpts, self.state_pool.num_sealed)
        if counted != (ckpts, locked_pages, locked_ckpts, ckpts):
            raise IntegrityError(f"tree: counters {counted} != recount {(ckpts, locked_pages, locked_ckpts, ckpts)}")
        if self.unified and self.kv_pool.num_used < len(seen) + ckpts * self.state_pool.pages_per_checkpoint:
            raise IntegrityError("budget: the tree holds more pages than the KV pool has in use")
        self.kv_pool.check_integrity()
        self.state_pool.check_integrity()


def _on_device(base: Node, path: list[Node], full_len: int) -> tuple[list[Node], int]:
    """The device part of a path walked from base (a prefix of it: nodes on the host sit below
    device ones) and the length of the tokens it covers."""
    device = list(itertools.takewhile(lambda x: not x.host, path))
    if len(device) == len(path):
        return device, full_len
    return device, device[-1].end if device else base.end
