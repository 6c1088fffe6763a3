"""Random insert / match / lock / unlock / evict / split / load sequences against a brute-force model.

The model keeps what should be cached as plain dicts: every page-aligned prefix the tree
holds on the device -> its page, every checkpointed prefix -> its slot, and the same for the
host tier. Page and slot contents encode the prefix they belong to, so a page reused while
still cached, or a round trip through the host that changes a byte, shows up as a wrong value.
Three memory modes: two pools bounded apart (the static split), one budget (checkpoints in
the KV pool's pages), one budget plus a host tier.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache

TOKENS = st.lists(st.integers(0, 2), max_size=20).map(tuple)


def tree_contents(cache: StateRadixCache, host: bool = False) -> tuple[dict[tuple, int], dict[tuple, object]]:
    """{prefix: page} and {prefix: checkpoint slot} read off the tree's device tier (host: the
    host tier's pages and checkpoints' page lists)."""
    kv, ck, ps = {}, {}, cache.page_size
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        if node.host == host:
            for i, page in enumerate(node.pages):
                kv[prefix + node.key[: (i + 1) * ps]] = page
        full = prefix + node.key
        ckpt = tuple(node.host_ckpt) if host and node.host_ckpt is not None else None if host else node.checkpoint
        if ckpt is not None:
            ck[full] = ckpt
        stack.extend((c, full) for c in node.children.values())
    return kv, ck


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        page=st.sampled_from([1, 2, 3]), g_pages=st.sampled_from([1, 2]),
        policy=st.sampled_from(["lru", "utility", "gdsf"]), num_pages=st.integers(4, 40),
        num_ckpts=st.integers(1, 5), mode=st.sampled_from(["split", "unified", "host"]), host_pages=st.integers(0, 30),
    )
    def setup(self, page, g_pages, policy, num_pages, num_ckpts, mode, host_pages):
        """mode: "split" for two pools bounded apart; "unified" for one budget, the KV pool's
        pages (a checkpoint holds 3 values: 1-3 pages); "host" for that plus a host tier of
        host_pages pages. num_ckpts: checkpoint slots, or staging rows under one budget."""
        kv = KVPool(num_pages, page, [{"kv": (1,)}], torch.float64, "cpu")
        self.budget = mode != "split"
        sp = StatePool(1, num_ckpts, [{"s": ((3,), torch.float64)}], "cpu", arena=kv if self.budget else None)
        self.host = KVPool(host_pages, page, [{"kv": (1,)}], torch.float64, "cpu") if mode == "host" else None
        self.cache = StateRadixCache(kv, sp, {"kda": page * g_pages}, CacheConfig(eviction=policy), flops=(1.0, 0.5),
                                     host=self.host)
        self.active = sp.alloc_active()
        self.ppc = sp.pages_per_checkpoint
        self.ps, self.g = page, page * g_pages
        self.ref_kv: dict[tuple, int] = {}
        self.ref_ck: dict[tuple, int] = {}
        self.ref_hkv: dict[tuple, int] = {}
        self.ref_hck: dict[tuple, object] = {}
        self.ids: dict[tuple, int] = {}
        self.locks: list[tuple[object, tuple]] = []
        self.known: list[tuple] = []

    # -- helpers ------------------------------------------------------------------------

    def _id(self, prefix: tuple) -> float:
        return float(self.ids.setdefault(prefix, len(self.ids) + 1))

    def _sync_after_eviction(self, loaded: bool = False) -> None:
        """Drop from the model what the cache evicted (or moved to the host), checking that it
        may have: nothing appears, device pages keep their ids (loaded: or came back from the host
        holding what they held there), host pages hold what they held."""
        kv, ck = tree_contents(self.cache)
        hkv, hck = tree_contents(self.cache, host=True)
        known_kv, known_ck = set(self.ref_kv) | set(self.ref_hkv), set(self.ref_ck) | set(self.ref_hck)
        assert set(kv) | set(hkv) <= known_kv and set(ck) | set(hck) <= known_ck, "eviction invented data"
        for p, page in kv.items():
            if p in self.ref_kv:
                assert page == self.ref_kv[p]
            else:
                assert loaded and p in self.ref_hkv
                assert self.cache.kv_pool.buffers[0]["kv"][page, 0, 0].item() == self._id(p), "loaded page differs"
        for p, slot in ck.items():
            if p in self.ref_ck:
                assert slot == self.ref_ck[p]
            else:
                assert loaded and p in self.ref_hck
                assert self._checkpoint_value(slot) == self._id(p), "loaded checkpoint differs"
        for p in kv:
            assert all(p[:i] in kv for i in range(self.ps, len(p), self.ps)), "KV kept without its prefix"
        for p in hkv:
            assert all(p[:i] in kv or p[:i] in hkv for i in range(self.ps, len(p), self.ps)), "host KV without prefix"
        assert all(p in kv or p in hkv for p in set(ck) | set(hck)), "checkpoint kept without its KV"
        if self.host is not None:
            for p, page in hkv.items():
                assert self.host.buffers[0]["kv"][page, 0, 0].item() == self._id(p), "host page holds other data"
        for p in self._protected_kv():
            assert p in kv, f"evicted locked KV {p}"
        for p in self._protected_ck():
            assert p in ck, f"evicted locked checkpoint {p}"
        self.ref_kv, self.ref_ck, self.ref_hkv, self.ref_hck = kv, ck, hkv, hck

    def _write_checkpoint(self, slot: int, prefix: tuple) -> None:
        self.cache.state_pool.buffers[0]["s"][self.cache.state_pool.row(slot)] = self._id(prefix)  # every value

    def _checkpoint_value(self, slot: int) -> float:
        sp = self.cache.state_pool
        sp.restore(slot, self.active)
        values = sp.buffers[0]["s"][self.active]
        assert (values == values[0]).all(), "a checkpoint's bytes were mixed up"
        return values[0].item()

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
        fresh = [self.cache.alloc_checkpoint(kind=("last", "decode")[p % 2]) for p in want]  # may evict (one budget)
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
                self._write_checkpoint(slot, tokens[:pos])
            if slot is not None:
                ckpts[pos] = slot
        before = set(self.ref_kv) | set(self.ref_hkv)
        res = self.cache.insert(tokens, mine, ckpts)
        for i in range(n_full):
            prefix = tokens[: (i + 1) * self.ps]
            assert res.pages[i] == self.ref_kv.get(prefix, mine[i])  # a host copy gives way to the fresh page
            self.ref_kv[prefix] = res.pages[i]
            self.ref_hkv.pop(prefix, None)
        for pos, slot in ckpts.items():
            if tokens[:pos] not in self.ref_ck:
                self.ref_ck[tokens[:pos]] = slot
                self.ref_hck.pop(tokens[:pos], None)
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
        self._write_checkpoint(slot, prefix)
        pages = [self.ref_kv[prefix[:i]] for i in range(self.ps, len(prefix) + 1, self.ps)]
        res = self.cache.insert(prefix, pages, {len(prefix): slot})
        assert (res.new_pages, res.freed_pages, res.new_checkpoints, res.pages) == (0, 0, 1, pages)
        self.ref_ck[prefix] = slot
        self.ref_hck.pop(prefix, None)

    def _lookup(self, tokens: tuple, data) -> tuple:
        """tokens, or often a known sequence plus one token (so lookups find what was cached)."""
        if self.known and data.draw(st.booleans()):
            return data.draw(st.sampled_from(self.known)) + (0,)
        return tokens

    @rule(tokens=TOKENS, data=st.data())
    def match(self, tokens, data):
        """match_prefix agrees with the model on kv_len, state_len, pages and contents."""
        tokens = self._lookup(tokens, data)
        m = self.cache.match_prefix(tokens)
        kv_len, state_len = self._expected_match(tokens)
        assert (m.kv_len, m.state_len, m.node.end) == (kv_len, state_len, state_len)
        assert m.pages == [self.ref_kv[tokens[: (i + 1) * self.ps]] for i in range(state_len // self.ps)]
        kv = self.cache.kv_pool.buffers[0]["kv"]
        for i, p in enumerate(m.pages):
            assert kv[p, 0, 0].item() == self._id(tokens[: (i + 1) * self.ps]), "page reused while cached"
        if state_len:
            assert m.checkpoint.slot == self.ref_ck[tokens[:state_len]]
            assert self._checkpoint_value(m.checkpoint.slot) == self._id(tokens[:state_len])
        else:
            assert m.checkpoint is None
        deeper = [p for p in range(state_len + self.g, len(tokens), self.g) if tokens[:p] in self.ref_hck
                  or tokens[:p] in self.ref_ck and tokens[:p] in self.ref_hkv]
        assert m.host_len == max(deeper, default=0), "host_len is not the deepest checkpoint the host tier adds"

    @rule(tokens=TOKENS, data=st.data())
    def load(self, tokens, data):
        """Loading a host hit makes it a device hit with the same bytes, or fails for lack of
        room and loses nothing."""
        tokens = self._lookup(tokens, data)
        m = self.cache.match_prefix(tokens, record_stats=False)
        if not m.host_len:
            return
        ok = self.cache.load(m)
        self._sync_after_eviction(loaded=True)
        after = self.cache.match_prefix(tokens, record_stats=False)
        if ok:
            assert after.state_len == m.host_len
        if after.state_len:
            assert self._checkpoint_value(after.checkpoint.slot) == self._id(tokens[:after.state_len])
        kv = self.cache.kv_pool.buffers[0]["kv"]
        for i, p in enumerate(after.pages):
            assert kv[p, 0, 0].item() == self._id(tokens[: (i + 1) * self.ps]), "a page changed on its round trip"

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
        if not self.budget:
            assert res.pages == self.cache.kv_pool.num_free - kv_free
            assert res.checkpoints == self.cache.state_pool.num_free_checkpoints - ck_free
            assert res.pages >= min(num_pages, unlocked_kv)
            assert res.checkpoints >= min(num_ckpts, unlocked_ck)
        else:  # checkpoints are pages of the KV pool
            freed = self.cache.kv_pool.num_free - kv_free
            assert freed == res.pages + res.checkpoints * self.ppc
            assert freed >= min(num_pages + num_ckpts * self.ppc, unlocked_kv + unlocked_ck * self.ppc)
        self._sync_after_eviction()

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        kv, ck = tree_contents(self.cache)
        assert kv == self.ref_kv and ck == self.ref_ck
        assert tree_contents(self.cache, host=True) == (self.ref_hkv, self.ref_hck)
        locked_kv, locked_ck = self._protected_kv(), self._protected_ck()
        stats = self.cache.stats()
        assert (stats.pages_locked, stats.checkpoints_locked) == (len(locked_kv), len(locked_ck))
        if not self.budget:
            assert self.cache.kv_pool.num_used == len(kv)
            assert self.cache.state_pool.num_checkpoints - self.cache.state_pool.num_free_checkpoints == len(ck)
            assert self.cache.evictable_pages == len(kv) - len(locked_kv)
            return
        assert self.cache.kv_pool.num_used == len(kv) + len(ck) * self.ppc, "pages held outside the one budget"
        assert self.cache.evictable_pages == len(kv) - len(locked_kv) + (len(ck) - len(locked_ck)) * self.ppc
        if self.host is not None:
            assert self.host.num_used == len(self.ref_hkv) + len(self.ref_hck) * self.ppc

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.unlock(node)
        self.cache.flush()
        self.cache.check_integrity()
        assert self.cache.kv_pool.num_free == self.cache.kv_pool.num_pages
        assert self.cache.state_pool.num_free_checkpoints == self.cache.state_pool.num_checkpoints
        assert self.host is None or self.host.num_free == self.host.num_pages


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestCacheProperties = CacheMachine.TestCase
TestCacheProperties.__doc__ = "Cache == brute-force model after every step; all pools free after flush."
