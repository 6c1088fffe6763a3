"""The scheduler's side of the prefix cache: what a request holds and when it changes hands.

    admit    match_prefix -> lock the hit node, restore its checkpoint into the request's
             own active slot (a copy), share the tree's pages for [0, state_len)
    stash    after a chunk: insert [0, end) with the chunk's checkpoints; the request's
             full pages move into the tree; lock the new node, unlock the old one
    decode   every G-position the decode state is copied to the rolling checkpoint slot
    release  insert what is computed (+ the rolling checkpoint), unlock, free the pages the
             tree did not take and the active slot; a finished request drops the transient
             chunk-end checkpoints it wrote (admission.transient) unless someone holds them
"""
from __future__ import annotations

import math
from typing import Callable

from scheduler.request import Req
from state_cache import DecodeCheckpoint, MatchResult, PrefixCache


class CacheManager:
    """Where checkpoints go is the cache's `admission`. With `enable_prefix_cache` off in its
    config, requests never resume from the cache, so no state checkpoint is taken (a copy of
    every state at each chunk end and decode grid point that nothing would read); full KV pages
    still enter the tree, which is how a request's pages are held."""

    def __init__(self, cache: PrefixCache, reserved: Callable[[], int] = lambda: 0):
        """reserved: the pages running requests may still allocate (checkpoints never take them)."""
        self.cache = cache
        self.reserved = reserved
        self.kv = cache.kv_pool
        self.states = cache.state_pool
        self.page_size = cache.page_size
        self.g = cache.granularity
        self.admission = cache.admission
        self.hits = cache.config.enable_prefix_cache

    def match(self, req: Req) -> MatchResult:
        """The cached prefix of req's fill ids (walked from the node req holds, if any); not
        counted in the cache's stats (admit() counts the one that is used)."""
        tokens = req.token_ids(req.fill_len) if self.hits else ()
        return self.cache.match_prefix(tokens, record_stats=False, start=req.node)

    def deeper_cached(self, req: Req) -> bool:
        """Whether the tree may hold more of req's fill than req does (an O(page) test)."""
        return self.hits and self.cache.continues(req.node, req.token_ids(req.fill_len))

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def admit(self, req: Req, m: MatchResult) -> bool:
        """Give req an active slot and the cached prefix m; False if no slot is free."""
        slot = self.states.alloc_active()
        if slot is None:
            return False
        req.state_slot = slot
        if not req.retractions:  # a re-admission also hits its own output: not a prompt hit
            req.kv_hit_tokens, req.cached_tokens = m.kv_len, m.state_len
            if self.hits:
                self.cache.record_lookup(req.fill_len, m)
        req.branch_pos = m.branch_pos
        self.adopt(req, m)
        return True

    def adopt(self, req: Req, m: MatchResult) -> None:
        """Resume req at m.state_len: use the tree's pages below it, and its checkpoint, which
        `restore` copies into req's slot once req runs. A request waiting on a leader adopts each
        deeper checkpoint the leader writes; only the last one is copied. The lock on m.node pins it."""
        if req.node is None:
            self.cache.lock(m.node)
        else:
            self.cache.relock(req.node, m.node)
        req.node = m.node
        req.restore_from = m.checkpoint
        stale = [p for p, t in zip(req.kv_pages, m.pages) if p != t]  # ours, superseded by the tree's
        self.kv.free(stale)
        req.kv_pages = list(m.pages) + req.kv_pages[len(m.pages):]
        req.prefix_len = req.extend_end = m.state_len

    def restore(self, req: Req) -> None:
        """Copy the checkpoint req adopted into its slot (before a round computes from it)."""
        if req.restore_from is not None:
            self.cache.restore(req.restore_from, req.active_slot)
            req.restore_from = None

    def ensure_pages(self, req: Req, tokens: int) -> bool:
        """Pages for the first `tokens` positions of req (evicting cached ones); False if not enough."""
        need = self.pages_for(tokens) - len(req.kv_pages)
        if need <= 0:
            return True
        pages = self.cache.alloc_pages(need)
        if pages is None:
            return False
        req.kv_pages += pages
        return True

    def chunk_checkpoints(self, req: Req, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """(position, slot) for the admitted checkpoints in (start, end], as far as slots are left.
        A kernel writes states G-multiples from a segment's start (and at its end), so a chunk
        starting off the grid (cuts not aligned) can checkpoint only its own end. None when
        requests never resume from the cache."""
        if not self.hits:
            return ()
        out = []
        for pos, kind in self.admission.prefill(start, end, req.fill_len, req.branch_pos, req.share_points).items():
            if start % self.g and pos != end:
                continue
            slot = self.cache.alloc_checkpoint(self.reserved(), kind=kind)
            if slot is None:
                break  # checkpoints are an optimisation: run without the rest
            out.append((pos, slot))
            if kind == self.admission.transient_kind:
                req.transient_ckpts.append(pos)
        return tuple(out)

    def stash(self, req: Req, end: int, checkpoints=()) -> None:
        """Chunk [.., end) is final: move its full pages and checkpoints into the tree."""
        r = self.cache.insert(req.token_ids(end), req.kv_pages, dict(checkpoints), start=req.node)
        req.kv_pages[r.first_page: r.first_page + len(r.pages)] = r.pages
        self.cache.relock(req.node, r.node)
        req.node = r.node
        if len(req.transient_ckpts) > 1:  # only the deepest transient chunk end is worth its bytes
            self.cache.drop_checkpoints(req.token_ids(end), [p for p in req.transient_ckpts[:-1] if p <= end],
                                        below=req.node)
            req.transient_ckpts = [p for p in req.transient_ckpts if p > end] or req.transient_ckpts[-1:]

    def after_decode(self, req: Req) -> None:
        """Checkpoint the decode state when prefix_len lands on the grid (if anything may resume from it)."""
        if not self.hits:
            return
        pos = req.prefix_len
        decision = self.admission.decode(pos)
        if decision is DecodeCheckpoint.NONE:
            return
        if decision is DecodeCheckpoint.KEEP:
            slot = self.cache.alloc_checkpoint(self.reserved(), staged=False, kind=self.admission.decode_kind(pos))
            if slot is not None:
                self.states.save(req.active_slot, slot)
                self.stash(req, pos, {pos: slot})
            return
        if req.rolling_ckpt is None:  # rolling: reuse the request's one writable slot
            slot = self.cache.alloc_checkpoint(self.reserved(), staged=False, kind="decode")
            if slot is None:
                return
        else:
            slot = req.rolling_ckpt[1]
        self.states.save(req.active_slot, slot)
        req.rolling_ckpt = (pos, slot)

    def release(self, req: Req) -> None:
        """Give back everything req holds; what it computed stays cached where it can."""
        if req.state_slot is None:
            return
        ckpts = dict([req.rolling_ckpt]) if req.rolling_ckpt else {}
        if req.prefix_len >= self.page_size:
            self.stash(req, req.prefix_len, ckpts)
        elif ckpts:
            self.states.free(req.rolling_ckpt[1])
        tree = self.cache_pages(req)
        self.kv.free(req.kv_pages[tree:])
        if req.node is not None:
            self.cache.unlock(req.node)
        if req.finished and req.transient_ckpts:  # a retracted request keeps them to resume from
            self.cache.drop_checkpoints(req.token_ids(max(req.transient_ckpts)), req.transient_ckpts, below=req.node)
            req.transient_ckpts = []
        self.states.free(req.state_slot)
        req.state_slot, req.node, req.kv_pages, req.rolling_ckpt, req.restore_from = None, None, [], None, None

    def cache_pages(self, req: Req) -> int:
        """How many of req's pages (a prefix of its page table) the tree owns."""
        return req.node.end // self.page_size if req.node is not None else 0

    def future_pages(self, req: Req, reserve: float, held: int | None = None) -> int:
        """Pages req may still allocate beyond the `held` it has (default: its page table): the
        rest of its fill, plus `reserve` of the new tokens it had left when admitted
        (max_len - fill_len; the decode so far is in its pages, not taken off twice)."""
        decode = math.ceil((req.max_len - req.fill_len) * reserve)
        return max(0, self.pages_for(req.fill_len + decode) - (len(req.kv_pages) if held is None else held))
