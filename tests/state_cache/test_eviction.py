"""Eviction: locks hold under memory pressure, policies order victims, the registry by name."""
import random

import pytest
import torch

from state_cache import (
    CacheConfig,
    Candidate,
    KVPool,
    PrefillFlops,
    StatePool,
    StateRadixCache,
    make_policy,
    make_pools,
    plan_memory,
    policy_names,
    register,
)
from state_cache.eviction import _POLICIES, KindRates, LRUPolicy, as_flops
from tests.state_cache.harness import KV_LAYERS, STATE_LAYERS, ToyEngine


def _cache(policy, page=2, chunk=4, pages=64, ckpts=8, flops=(1.0, 1.0)) -> StateRadixCache:
    return StateRadixCache(KVPool(pages, page, [{"kv": (1, 4)}]), StatePool(1, ckpts, STATE_LAYERS),
                           {"kda": chunk}, CacheConfig(eviction=policy, eviction_recency_weight=0.3), flops=flops)


def _insert(cache, tokens, ckpt_positions=()):
    ckpts = {p: cache.alloc_checkpoint() for p in ckpt_positions}
    return cache.insert(tokens, cache.alloc_pages(len(tokens) // cache.page_size), ckpts)


@pytest.mark.parametrize("policy", ["lru", "utility", "gdsf"])
def test_locked_prefixes_survive_eviction_under_a_byte_budget(policy):
    """With pools sized from a byte budget, a workload that overflows them never evicts a locked
    node's pages or checkpoint, nor its ancestors' pages (their checkpoints may go)."""
    plan = plan_memory(KV_LAYERS, STATE_LAYERS, budget_bytes=12_000, page_size=8, max_running=2,
                       checkpoint_share=0.25, kv_dtype=torch.float64)
    kv, st = make_pools(plan, KV_LAYERS, STATE_LAYERS, torch.float64, "cpu")
    cache = StateRadixCache(kv, st, {"kda": 16}, config=CacheConfig(eviction=policy), flops=(1.0, 0.01))
    engine = ToyEngine(cache, chunk=32, interval=32)
    rng = random.Random(1)
    held = [rng.randrange(100) for _ in range(100)]
    engine.run(held, [1, 2])
    pinned = cache.match_prefix(held)
    cache.lock(pinned.node)
    assert pinned.state_len == 96
    for _ in range(25):
        engine.run([rng.randrange(100) for _ in range(rng.randrange(20, 120))], [3, 4, 5])
        cache.check_integrity()
    s = cache.stats()
    assert s.evicted_pages > 0 and s.evicted_checkpoints > 0
    again = cache.match_prefix(held)
    assert again == pinned
    assert s.pages_locked == 12 and s.checkpoints_locked == 1  # the one at 96; those at 32 and 64 may go
    cache.unlock(pinned.node)


def test_utility_prefers_low_utility_checkpoints_lru_prefers_old_ones():
    """Under `utility` the checkpoint saving the fewest FLOPs per byte goes first; under `lru` the oldest."""
    victims = {}
    for policy in ("lru", "utility"):
        cache = _cache(policy)
        _insert(cache, list(range(32)), [32])  # old, saves prefill of 32 tokens
        _insert(cache, list(range(100, 132)), [4])  # new, saves 4 tokens
        assert cache.evict(num_checkpoints=1) == (0, 1)
        left = [cache.match_prefix(list(start + i for i in range(32)) + [0]).state_len for start in (0, 100)]
        victims[policy] = "deep" if left == [0, 4] else "shallow" if left == [32, 0] else left
        cache.check_integrity()
    assert victims == {"lru": "deep", "utility": "shallow"}


def test_utility_evicts_kv_without_checkpoint_first():
    """Under `utility` a KV-only leaf goes before an older leaf that holds a checkpoint; `lru` takes the older."""
    for policy, survivor in (("lru", 100), ("utility", 0)):
        cache = _cache(policy)
        _insert(cache, list(range(8)), [8])
        _insert(cache, list(range(100, 108)))
        res = cache.evict(num_pages=1)
        assert res.pages == 4
        assert cache.match_prefix(list(range(survivor, survivor + 8))).kv_len == 8
        cache.check_integrity()


def test_kv_eviction_takes_its_checkpoint_and_a_checkpoint_can_go_alone():
    """Evicting a node's pages frees its checkpoint; evicting a checkpoint alone keeps the KV."""
    cache = _cache("lru")
    tokens = list(range(16))
    _insert(cache, tokens, [8, 16])
    cache.match_prefix(tokens[:9])  # [0, 8) is now newer than [8, 16)
    assert cache.evict(num_checkpoints=1) == (0, 1)
    m = cache.match_prefix(tokens + [1])
    assert (m.kv_len, m.state_len) == (16, 8)
    assert cache.evict(num_pages=8) == (8, 1)
    assert cache.stats().checkpoints_cached == 0 and cache.kv_pool.num_free == 64
    cache.check_integrity()


def test_eviction_only_frees_whole_unlocked_leaves_first():
    """A shared prefix is not evicted while a longer branch below it still holds pages."""
    cache = _cache("lru")
    _insert(cache, list(range(8)) + [50] * 8)
    _insert(cache, list(range(8)) + [60] * 8)
    cache.match_prefix(list(range(8)) + [60] * 8)
    assert cache.evict(num_pages=1) == (4, 0)
    assert cache.match_prefix(list(range(8)) + [60] * 8).kv_len == 16
    assert cache.match_prefix(list(range(8)) + [50] * 8).kv_len == 8


def test_policy_registry_by_name():
    """Policies are chosen by name; an unknown name lists the known ones; register adds one."""
    assert {"gdsf", "lru", "utility"} <= set(policy_names())
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; known: .*lru.*utility"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="eviction: unknown eviction policy 'fifo'; known: .*lru.*utility"):
        _cache("fifo")

    @register("newest_first")
    class NewestFirst(LRUPolicy):
        def scorer(self, candidates):
            return lambda c: -c.last_access

    try:
        cache = _cache("newest_first")
        _insert(cache, list(range(8)))
        _insert(cache, list(range(100, 108)))
        cache.evict(num_pages=1)
        assert cache.match_prefix(list(range(8))).kv_len == 8
    finally:
        del _POLICIES["newest_first"]


def test_utility_scorer_blends_flops_per_byte_with_recency():
    """priority = (1 - w) * utility / max + w * recency, clamped for candidates outside the fitted range."""
    cands = [Candidate(0.0, 100.0, 10), Candidate(10.0, 10.0, 10), Candidate(5.0, 0.0, 10)]
    score = make_policy("utility", recency_weight=0.5).scorer(cands)
    assert [score(c) for c in cands] == [0.5, 0.5 * 0.1 + 0.5, 0.25]
    assert score(Candidate(20.0, 1e9, 1)) == 1.0
    assert make_policy("utility", recency_weight=0.0).scorer([])(Candidate(1.0, 0.0, 0)) == 0.0
    with pytest.raises(ValueError, match="recency_weight"):
        make_policy("utility", recency_weight=1.5)


def test_flops_models():
    """FLOPs come from a callable, a (per_token, attn_quadratic) pair, or default to one per token."""
    assert PrefillFlops(3.0, 0.5)(4) == 12.0 + 8.0
    assert as_flops((3.0, 0.5))(4) == 20.0
    assert as_flops(lambda p: p ** 3)(2) == 8
    assert as_flops(None)(7) == 7.0
    with pytest.raises(ValueError, match="attn_quadratic"):
        PrefillFlops(1.0, -1.0)


def _unified(pages: int, policy=None, host_pages: int | None = None, config=None) -> StateRadixCache:
    """One budget of `pages` pages of 16 B; a checkpoint (96 B) takes 6 of them."""
    kv = KVPool(pages, 2, [{"kv": (1, 4)}])
    host = KVPool(host_pages, 2, [{"kv": (1, 4)}]) if host_pages is not None else None
    return StateRadixCache(kv, StatePool(1, 8, STATE_LAYERS, arena=kv), {"kda": 2}, config, policy=policy, host=host)


def test_one_byte_budget_evicts_either_kind_in_policy_order():
    """Under one byte budget (checkpoints stored in the KV pool's pages) the candidates of both
    kinds are ranked together: a page allocation frees an inner node's checkpoint alone when
    the policy ranks it lowest, a checkpoint allocation frees KV; locked nodes stay."""

    class LargestFirst(LRUPolicy):
        def scorer(self, candidates):
            return lambda c: -c.nbytes

    cache = _unified(14, LargestFirst())
    assert cache.state_pool.pages_per_checkpoint == 6 and cache.budget_bytes == 14 * 16
    a = list(range(8))
    _insert(cache, a, [4])  # 4 pages and an inner checkpoint at 4: 10 pages of 14
    locked = _insert(cache, [50, 51, 52, 53])  # 2 more pages, kept locked
    cache.lock(locked.node)
    assert cache.free_pages == 2 and cache.evictable_pages == 10
    pages = cache.alloc_pages(3)  # 1 page short: the 6-page checkpoint ranks lowest and goes alone
    assert pages is not None and cache.stats().evicted_checkpoints == 1 and cache.stats().evicted_pages == 0
    assert cache.match_prefix(a).kv_len == 8 and cache.match_prefix(a).state_len == 0  # the KV stayed
    cache.kv_pool.free(pages)

    lru = _unified(14)
    _insert(lru, a)  # 4 pages, oldest
    _insert(lru, [60, 61, 62, 63], [4])  # 2 pages + a checkpoint: 12 pages
    slot = lru.alloc_checkpoint()  # 6 pages needed, 2 free: the oldest KV (a's leaf) goes for it
    assert slot is not None and lru.match_prefix(a).kv_len == 0
    assert lru.match_prefix([60, 61, 62, 63, 0]).state_len == 4
    assert lru.kv_pool.num_free == 0
    lru.state_pool.free(slot)
    cache.unlock(locked.node)
    for c in (cache, lru):
        c.check_integrity()
        c.flush()
        assert c.kv_pool.num_free == c.kv_pool.num_pages and c.state_pool.num_free_checkpoints == 8


def test_host_tier_keeps_what_the_device_evicts_and_loads_it_back():
    """With a host tier, device eviction moves a leaf (KV + checkpoint) to the host instead of
    dropping it; a lookup then reports the deeper host hit (host_len, the bytes to copy), and
    load() brings it back: the same match as before the eviction, with the same bytes."""
    cache = _unified(14, host_pages=20)
    kv_pool = cache.kv_pool
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    pages = cache.alloc_pages(4)
    slot = cache.alloc_checkpoint()
    cache.insert(a, pages, {8: slot})  # 4 pages + a checkpoint at 8: 10 of 14
    before = cache.match_prefix(a + [0])
    assert before.state_len == 8 and before.host_len == 0
    assert cache.alloc_pages(14) is not None  # everything must go: to the host
    after = cache.match_prefix(a + [0])
    assert (after.kv_len, after.state_len, after.host_len) == (0, 0, 8)
    assert after.host_bytes == 4 * 16 + 6 * 16
    st_ = cache.stats()
    assert (st_.host_pages_cached, st_.host_checkpoints_cached, st_.bytes_to_host) == (4, 1, 10 * 16)
    assert not cache.load(after)  # no device room: nothing is lost
    cache.check_integrity()
    kv_pool.free(list(range(14)))
    assert cache.load(cache.match_prefix(a + [0]))
    again = cache.match_prefix(a + [0])
    assert (again.kv_len, again.state_len, again.host_len) == (8, 8, 0)
    assert cache.stats().host_hit_tokens == 8 and cache.stats().host_pages_cached == 0
    cache.check_integrity()


def test_host_tier_eviction_and_recompute_replace_host_copies():
    """A full host tier evicts its own leaves in policy order (the oldest under lru), and a
    request that recomputes a prefix held on the host replaces the host copy with its pages."""
    cache = _unified(10, host_pages=4, config=CacheConfig(eviction="lru"))
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    _insert(cache, old)
    _insert(cache, new)
    held = cache.alloc_pages(10)  # both leaves move to the host (2 + 2 pages: it is full)
    assert cache.stats().host_pages_cached == 4
    cache.kv_pool.free(held)
    third = _insert(cache, [9, 10, 11, 12])
    held = cache.alloc_pages(10)  # the third leaf needs host room: the oldest host leaf goes
    m_old, m_new = cache.match_prefix(old + [0]), cache.match_prefix(new + [0])
    assert m_old.host_len == 0 and cache.match_prefix(old).kv_len == 0
    assert cache.stats().host_evicted_pages == 2 and cache.stats().host_pages_cached == 4
    assert third.node.host
    cache.kv_pool.free(held)
    mine = cache.alloc_pages(2)
    res = cache.insert(new, mine)  # recomputed: the fresh device pages replace the host copy
    assert res.pages == mine and not res.node.host and cache.stats().host_pages_cached == 2
    assert m_new.host_len == 0  # no checkpoint on that path: KV alone is no usable host hit
    cache.check_integrity()


def test_shadowed_and_unused_checkpoints_go_first():
    """A checkpoint with a deeper one on its only continuation (every request through it went
    on) loses to that deeper one under utility, and a lookup resuming from the deeper one
    refreshes only that one's recency."""
    cache = _cache("utility", ckpts=2, flops=(1.0, 0.0))
    seq = list(range(16))
    _insert(cache, seq[:12], [12])  # the prompt's checkpoint P (at 12: 12 FLOPs above the root)
    _insert(cache, seq, [16])  # the same request's decode checkpoint D (4 FLOPs above P); P is shadowed
    for _ in range(3):
        assert cache.match_prefix(seq + [99]).state_len == 16  # next turns resume from D
    slot = cache.alloc_checkpoint()  # the pool is full: one of the two goes
    assert slot is not None and cache.match_prefix(seq + [99]).state_len == 16
    assert cache.match_prefix(seq[:12] + [5]).state_len == 0  # P went, though it saves more FLOPs than D
    cache.state_pool.free(slot)
    cache.check_integrity()


def test_gdsf_ages_entries_by_the_level_of_their_last_use():
    """gdsf: priority = L(last use) + FLOPs per byte, L rising to each evicted priority; an
    entry worth more per byte but untouched since L rose goes before a newer, cheaper one."""
    gd = make_policy("gdsf")
    old, new = Candidate(5.0, 30.0, 10), Candidate(12.0, 10.0, 10)  # 3 and 1 FLOPs per byte
    assert gd.scorer([old, new])(old) > gd.scorer([old, new])(new)  # nothing evicted yet: worth decides
    gd.scorer([old, Candidate(10.0, 0.0, 1)])  # a round whose newest use was at 10 ...
    gd.evicted(4.0)  # ... evicts a candidate of priority 4: from 10 on the level is 4
    gd.evicted(2.0)  # a lower priority never lowers the level
    assert (gd.level(9.9), gd.level(10.0), gd.level(11.5)) == (0.0, 4.0, 4.0)
    score = gd.scorer([old, new])
    assert (score(old), score(new)) == (3.0, 5.0)  # old is now the first to go
    short = make_policy("gdsf", history=2)
    for t in range(1, 8):
        short.scorer([Candidate(float(t), 0.0, 1)])
        short.evicted(float(t))
    assert short.level(100.0) == 7.0 and short.level(0.5) == short.level(3.0)  # aged as of the oldest kept
    with pytest.raises(ValueError, match="history"):
        make_policy("gdsf", history=0)


def test_kind_rates_are_resumes_per_checkpoint_written_and_follow_the_traffic():
    rates = KindRates(window=100)
    assert rates.rate("decode") == 1.0  # nothing known yet
    for _ in range(9):
        rates.written("decode")
        rates.written("last")
    for _ in range(9):
        rates.resumed("last")
    assert rates.rate("decode") == 0.1 and rates.rate("last") == 1.0
    for _ in range(82):
        rates.written("decode")  # the 100th write halves every count
    assert rates.rate("decode") == 1 / (91 / 2 + 1) and rates.rate("last") == (4.5 + 1) / (4.5 + 1)
    assert set(rates.snapshot()) == {"decode", "last"}
    with pytest.raises(ValueError, match="window"):
        KindRates(window=0)


@pytest.mark.parametrize("learn", [True, False])
def test_a_kind_never_resumed_from_goes_first(learn):
    """With kind rates, a checkpoint whose kind the traffic never resumes from (a decode state
    nobody continues) goes before one of a kind that is resumed, though it saves more FLOPs;
    without them the FLOPs decide."""
    cache = StateRadixCache(KVPool(64, 2, [{"kv": (1, 4)}]), StatePool(1, 3, STATE_LAYERS), {"kda": 2},
                            CacheConfig(eviction_kind_rates=learn), flops=(1.0, 0.0))

    def put(tokens, pos, kind):
        slot = cache.alloc_checkpoint(kind=kind)
        cache.insert(tokens, cache.alloc_pages(len(tokens) // 2), {pos: slot})

    for i in range(8):  # earlier traffic: resends come back to "last", never to "decode"
        put([i] * 4, 4, "last")
        for _ in range(2):
            assert cache.match_prefix([i] * 4 + [9]).state_len == 4
        put([i] * 4 + [7, 7, 7, 7], 8, "decode")
        cache.evict(num_checkpoints=cache.state_pool.num_checkpoints - cache.state_pool.num_free_checkpoints)
    assert cache.kind_rates.rate("decode") < 0.2 < 1.0 < cache.kind_rates.rate("last")
    cache.evict(num_pages=64)
    put(list(range(10, 14)), 4, "last")  # saves 4 FLOPs
    put(list(range(20, 36)), 16, "decode")  # saves 16 FLOPs
    cache.evict(num_checkpoints=1)
    kept = {n: cache.match_prefix(list(range(n, n + 16)) + [0]).state_len for n in (10, 20)}
    assert kept == ({10: 4, 20: 0} if learn else {10: 0, 20: 16})
    cache.check_integrity()
