"""Random insert / match / lock / unlock / evict / split sequences against a brute-force model.

The model keeps what should be cached as plain dicts: every page-aligned prefix the tree
holds -> its page, every checkpointed prefix -> its slot. Page and slot contents encode the
prefix they belong to, so a page reused while still cached shows up as a wrong value.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache

TOKENS = st.lists(st.integers(0, 2), max_size=20).map(tuple)


def tree_contents(cache: StateRadixCache) -> tuple[dict[tuple, int], dict[tuple, int]]:
    """{prefix: page} and {prefix: checkpoint slot} read off the tree."""
    kv, ck, ps = {}, {}, cache.page_size
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, page in enumerate(node.pages):
            kv[prefix + node.key[: (i + 1) * ps]] = page
        full = prefix + node.key
        if node.checkpoint is not None:
            ck[full] = node.checkpoint
        stack.extend((c, full) for c in node.children.values())
    return kv, ck


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 3]), g_pages=st.sampled_from([1, 2]),
        policy=st.sampled_from(["lru", "utility"]), num_pages=st.integers(4, 40),
        num_ckpts=st.integers(1, 5), budget=st.one_of(st.none(), st.floats(0.1, 1.0)),
    )
    def setup(self, page, g_pages, policy, num_pages, num_ckpts, budget):
        """budget: None for two pools bounded apart, else one byte budget of that share of both
        pools' bytes (checkpoint slots hold 2 values: a checkpoint costs as much as 2 tokens)."""
        kv = KVPool(num_pages, page, [{"kv": (1,)}], torch.float64, "cpu")
        sp = StatePool(1, num_ckpts, [{"s": ((2,), torch.float64)}], "cpu")
        total = num_pages * kv.bytes_per_page + num_ckpts * sp.bytes_per_slot
        self.budget = None if budget is None else int(budget * total)
        self.cache = StateRadixCache(kv, sp, {"kda": page * g_pages}, CacheConfig(eviction=policy), flops=(1.0, 0.5),
                                     budget_bytes=self.budget)
        self.ps, self.g = page, page * g_pages
        self.ref_kv: dict[tuple, int] = {}
        self.ref_ck: dict[tuple, int] = {}
        self.ids: dict[tuple, int] = {}
        self.locks: list[tuple[object, tuple]] = []
        self.known: list[tuple] = []

    # -- helpers ------------------------------------------------------------------------

    def _id(self, prefix: tuple) -> float:
        return float(self.ids.setdefault(prefix, len(self.ids) + 1))

    def _sync_after_eviction(self) -> None:
        """Drop from the model what the cache evicted, checking that it may have."""
        kv, ck = tree_contents(self.cache)
        assert set(kv) <= set(self.ref_kv) and set(ck) <= set(self.ref_ck), "eviction invented data"
        assert all(kv[p] == self.ref_kv[p] for p in kv) and all(ck[p] == self.ref_ck[p] for p in ck)
        for p in kv:
            assert all(p[:i] in kv for i in range(self.ps, len(p), self.ps)), "KV kept without its prefix"
        assert all(p in kv for p in ck), "checkpoint kept without its KV"
        for p in self._protected_kv():
            assert p in kv, f"evicted locked KV {p}"
        for p in self._protected_ck():
            assert p in ck, f"evicted locked checkpoint {p}"
        self.ref_kv, self.ref_ck = kv, ck

    def _protected_kv(self) -> set[tuple]:
        return {t[:i] for _, t in self.locks for i in range(self.ps, len(t) + 1, self.ps)}

    def _protected_ck(self) -> set[tuple]:
        """Checkpoints on the locked nodes themselves (those above them may be evicted)."""
        return {p for p in self.ref_ck if any(t == p for _, t in self.locks)}

    def _expected_match(self, tokens: tuple) -> tuple[int, int]:
        kv_len = max(L for L in range(0, len(tokens) + 1, self.ps) if L == 0 or tokens[:L] in self.ref_kv)
        state = [p for p in range(self.g, min(kv_len, len(tokens) - 1) + 1, self.g) if tokens[:p] in self.ref_ck]
        return kv_len, max(state, default=0)

    # -- rules --------------------------------------------------------------------------

    @rule(tokens=TOKENS, data=st.data(), reuse=st.booleans(), lock=st.booleans())
    def insert(self, tokens, data, reuse, lock):
        """Insert a sequence, or a prefix of a known one, with checkpoints at random grid points."""
        if self.known and data.draw(st.booleans()):
            known = data.draw(st.sampled_from(self.known))
            tokens = known[: data.draw(st.integers(0, len(known)))]
        n_full = len(tokens) // self.ps
        mine = self.cache.alloc_pages(n_full)
        self._sync_after_eviction()
        if mine is None:
            return
        grid = list(range(self.g, n_full * self.ps + 1, self.g))
        want = data.draw(st.lists(st.sampled_from(grid), unique=True)) if grid else []
        fresh = [self.cache.alloc_checkpoint() for _ in want]  # may evict cached pages (one budget)
        self._sync_after_eviction()
        kv = self.cache.kv_pool.buffers[0]["kv"]
        for i, p in enumerate(mine):  # reuse only what survived every allocation above
            kv[p] = self._id(tokens[: (i + 1) * self.ps])
            prefix = tokens[: (i + 1) * self.ps]
            if reuse and prefix in self.ref_kv and all(tokens[: j * self.ps] in self.ref_kv for j in range(1, i + 1)):
                self.cache.kv_pool.free([p])
                mine[i] = self.ref_kv[prefix]
        ckpts = {}
        for pos, slot in zip(want, fresh):
            if reuse and tokens[:pos] in self.ref_ck and slot is not None:
                self.cache.state_pool.free(slot)
                slot = self.ref_ck[tokens[:pos]]
            elif slot is not None:
                self.cache.state_pool.buffers[0]["s"][slot] = self._id(tokens[:pos])  # both values
            if slot is not None:
                ckpts[pos] = slot
        before = set(self.ref_kv)
        res = self.cache.insert(tokens, mine, ckpts)
        for i in range(n_full):
            prefix = tokens[: (i + 1) * self.ps]
            assert res.pages[i] == self.ref_kv.get(prefix, mine[i])
            self.ref_kv[prefix] = res.pages[i]
        for pos, slot in ckpts.items():
            self.ref_ck.setdefault(tokens[:pos], slot)
        assert res.new_pages == len(set(self.ref_kv) - before)
        assert res.node.end == n_full * self.ps
        if lock:
            self.cache.lock(res.node)
            self.locks.append((res.node, tokens[: n_full * self.ps]))
        self.known.append(tokens)

    @rule(data=st.data())
    def split(self, data):
        """Add a checkpoint where only KV is cached (often inside an edge): pages stay, the tree splits."""
        spots = sorted(p for p in self.ref_kv if len(p) % self.g == 0 and p not in self.ref_ck)
        if not spots:
            return
        prefix = data.draw(st.sampled_from(spots))
        slot = self.cache.alloc_checkpoint()
        self._sync_after_eviction()
        if slot is not None and prefix not in self.ref_kv:  # the allocation evicted it
            self.cache.state_pool.free(slot)
        if slot is None or prefix not in self.ref_kv:
            return
        self.cache.state_pool.buffers[0]["s"][slot] = self._id(prefix)
        pages = [self.ref_kv[prefix[:i]] for i in range(self.ps, len(prefix) + 1, self.ps)]
        res = self.cache.insert(prefix, pages, {len(prefix): slot})
        assert (res.new_pages, res.freed_pages, res.new_checkpoints, res.pages) == (0, 0, 1, pages)
        self.ref_ck[prefix] = slot

    @rule(tokens=TOKENS)
    def match(self, tokens):
        """match_prefix agrees with the model on kv_len, state_len, pages and contents."""
        m = self.cache.match_prefix(tokens)
        kv_len, state_len = self._expected_match(tokens)
        assert (m.kv_len, m.state_len, m.node.end) == (kv_len, state_len, state_len)
        assert m.pages == [self.ref_kv[tokens[: (i + 1) * self.ps]] for i in range(state_len // self.ps)]
        kv = self.cache.kv_pool.buffers[0]["kv"]
        for i, p in enumerate(m.pages):
            assert kv[p, 0, 0].item() == self._id(tokens[: (i + 1) * self.ps]), "page reused while cached"
        if state_len:
            assert m.checkpoint.slot == self.ref_ck[tokens[:state_len]]
            assert self.cache.state_pool.buffers[0]["s"][m.checkpoint.slot, 1].item() == self._id(tokens[:state_len])
        else:
            assert m.checkpoint is None

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens, record_stats=False)
        self.cache.lock(m.node)
        self.locks.append((m.node, tokens[: m.state_len]))

    @rule(data=st.data())
    def unlock(self, data):
        if not self.locks:
            return
        node, _ = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(node)

    @rule(num_pages=st.integers(0, 8), num_ckpts=st.integers(0, 3))
    def evict(self, num_pages, num_ckpts):
        """Eviction frees what it reports, all of it when asked for more, never anything locked;
        under one byte budget it frees at least the bytes asked for, of either kind."""
        kv_free, ck_free = self.cache.kv_pool.num_free, self.cache.state_pool.num_free_checkpoints
        unlocked_kv = len(set(self.ref_kv) - self._protected_kv())
        unlocked_ck = len(set(self.ref_ck) - self._protected_ck())
        res = self.cache.evict(num_pages=num_pages, num_checkpoints=num_ckpts)
        assert res.pages == self.cache.kv_pool.num_free - kv_free
        assert res.checkpoints == self.cache.state_pool.num_free_checkpoints - ck_free
        if self.budget is None:
            assert res.pages >= min(num_pages, unlocked_kv)
            assert res.checkpoints >= min(num_ckpts, unlocked_ck)
        else:
            pb, cb = self.cache.kv_pool.bytes_per_page, self.cache.state_pool.bytes_per_slot
            freed, asked = res.pages * pb + res.checkpoints * cb, num_pages * pb + num_ckpts * cb
            assert freed >= min(asked, unlocked_kv * pb + unlocked_ck * cb)
        self._sync_after_eviction()

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        kv, ck = tree_contents(self.cache)
        assert kv == self.ref_kv and ck == self.ref_ck
        assert self.cache.kv_pool.num_used == len(kv)
        locked_kv, locked_ck = self._protected_kv(), self._protected_ck()
        stats = self.cache.stats()
        assert (stats.pages_locked, stats.checkpoints_locked) == (len(locked_kv), len(locked_ck))
        assert self.cache.state_pool.num_checkpoints - self.cache.state_pool.num_free_checkpoints == len(ck)
        if self.budget is None:
            assert self.cache.evictable_pages == len(kv) - len(locked_kv)
            return
        pb, cb = self.cache.kv_pool.bytes_per_page, self.cache.state_pool.bytes_per_slot
        unlocked = (len(kv) - len(locked_kv)) * pb + (len(ck) - len(locked_ck)) * cb
        assert self.cache.evictable_pages == unlocked // pb
        assert len(kv) * pb + len(ck) * cb <= self.budget, "the cache holds more bytes than its budget"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.unlock(node)
        self.cache.flush()
        self.cache.check_integrity()
        assert self.cache.kv_pool.num_free == self.cache.kv_pool.num_pages
        assert self.cache.state_pool.num_free_checkpoints == self.cache.state_pool.num_checkpoints


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestCacheProperties = CacheMachine.TestCase
TestCacheProperties.__doc__ = "Cache == brute-force model after every step; all pools free after flush."
