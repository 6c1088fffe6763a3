"""StateRadixCache: grid, matching, insert ownership, splits, locks, stats."""
import random

import pytest

from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache, granularity
from tests.state_cache.harness import ToyEngine, make_cache


def _cache(page=2, chunk=4, pages=64, ckpts=8, **kw) -> StateRadixCache:
    return StateRadixCache(KVPool(pages, page), StatePool(2, ckpts), {"kda": chunk}, **kw)


def _insert(cache, tokens, ckpt_positions=()):
    pages = cache.alloc_pages(len(tokens) // cache.page_size)
    ckpts = {p: cache.alloc_checkpoint() for p in ckpt_positions}
    return cache.insert(tokens, pages, ckpts)


@pytest.mark.parametrize("page,chunks,g", [(16, {"kda": 64}, 64), (128, {"kda": 64}, 128), (1, {"gdn": 64}, 64),
                                           (64, {"mamba2": 256, "kda": 64}, 256)])
def test_granularity_is_max_of_chunk_and_page(page, chunks, g):
    """G = max(kernel chunk, page_size) over every linear-layer kind."""
    assert granularity(page, chunks) == g
    assert _cache(page=page, chunk=max(chunks.values())).granularity == max(page, *chunks.values())


@pytest.mark.parametrize("page,chunks,field", [(48, {"kda": 64}, "kernel_chunks\\['kda'\\]"),
                                               (64, {"mamba2": 96}, "kernel_chunks\\['mamba2'\\]"),
                                               (32, {"kda": 64, "mamba2": 96}, "kernel_chunks\\['kda'\\]"),
                                               (0, {"kda": 64}, "page_size")])
def test_granularity_rejects_indivisible_sizes(page, chunks, field):
    """A chunk and page size that do not divide each other raise ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        granularity(page, chunks)


def test_match_never_resumes_at_the_last_token():
    """state_len <= len(tokens) - 1 even when a checkpoint sits exactly at len(tokens)."""
    cache = _cache()
    tokens = list(range(12))
    _insert(cache, tokens, [4, 8, 12])
    assert cache.match_prefix(tokens).state_len == 8
    assert cache.match_prefix(tokens + [99]).state_len == 12
    assert cache.match_prefix(tokens[:9]).state_len == 8
    assert cache.match_prefix(tokens[:8]).state_len == 4
    assert cache.match_prefix([]).state_len == 0


def test_split_keeps_checkpoints_and_locks():
    """Splitting an edge (by a branch or a new checkpoint) keeps every checkpoint and lock in place."""
    cache = _cache()
    a = list(range(16))
    res = _insert(cache, a, [12])
    cache.lock(res.node)
    _insert(cache, a[:6] + [50] * 10, [4])  # branches at 6: splits at 6 and at 4
    _insert(cache, a, [8])  # checkpoint inside the lower edge: splits at 8
    assert [cache.match_prefix(a[:p] + [99]).state_len for p in (4, 8, 12, 16)] == [4, 8, 12, 12]
    assert cache.stats().pages_locked == 8
    cache.check_integrity()
    cache.unlock(res.node)
    assert cache.stats().pages_locked == 0
    cache.check_integrity()


def test_insert_transfers_pages_and_frees_duplicates():
    """Insert adopts new pages, frees the caller's copies of cached ones, leaves the partial page alone."""
    cache = _cache()
    tokens = list(range(9))
    first = cache.insert(tokens, cache.alloc_pages(5))
    assert (first.new_pages, first.freed_pages, len(first.pages)) == (4, 0, 4)
    assert cache.kv_pool.num_used == 5  # 4 in the tree + the caller's partial page
    mine = cache.alloc_pages(5)
    second = cache.insert(tokens + [9], mine)
    assert (second.new_pages, second.freed_pages) == (1, 4)
    assert second.pages == first.pages + [mine[4]]
    assert cache.kv_pool.num_used == 6
    again = cache.insert(tokens + [9], second.pages)  # the tree's own pages: a no-op
    assert (again.new_pages, again.freed_pages, again.pages) == (0, 0, second.pages)
    cache.check_integrity()


def test_duplicate_checkpoint_is_freed_by_insert():
    """A checkpoint for a position the tree already holds is freed there, the cached one stays."""
    cache = _cache()
    tokens = list(range(8))
    first = _insert(cache, tokens, [4])
    second = _insert(cache, tokens, [4, 8])
    assert (first.new_checkpoints, second.new_checkpoints, second.freed_checkpoints) == (1, 1, 1)
    assert cache.stats().checkpoints_cached == 2 and cache.state_pool.num_free_checkpoints == 6
    cache.check_integrity()


def test_bad_insert_raises_and_leaves_the_tree_intact():
    """Invalid positions, slots or pages raise ValueError naming the argument; nothing changes."""
    cache = _cache()
    tokens = list(range(8))
    tree_pages = _insert(cache, tokens, [4]).pages
    slot, pages = cache.alloc_checkpoint(), cache.alloc_pages(4)
    before = cache.stats()
    cases = [
        ((tokens, pages, {6: slot}), "checkpoints: position 6"),
        ((tokens, pages, {12: slot}), "checkpoints: position 12"),
        ((tokens, pages, {4: 0}), "checkpoints: slot 0"),
        ((tokens, pages[:3], {}), "kv_pages: 3 pages"),
        ((tokens, [pages[0]] * 4, {}), "kv_pages: a page appears twice"),
        ((list(range(100, 108)), tree_pages, {}), "kv_pages: page 0 belongs to the tree"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            cache.insert(*args)
    assert cache.stats() == before
    cache.kv_pool.free(pages)
    cache.state_pool.free(slot)
    cache.check_integrity()


def test_locks_are_counted_and_checked():
    """Unlock without lock and lock of an evicted node raise; nested locks need as many unlocks."""
    cache = _cache()
    res = _insert(cache, list(range(8)), [8])
    with pytest.raises(ValueError, match="node: unlock without a matching lock"):
        cache.unlock(res.node)
    cache.lock(res.node)
    cache.lock(res.node)
    cache.unlock(res.node)
    assert cache.evict(num_pages=10).pages == 0
    cache.unlock(res.node)
    assert cache.evict(num_pages=10).pages == 4
    with pytest.raises(ValueError, match="node: it was evicted"):
        cache.lock(res.node)
    cache.check_integrity()


def test_branch_pos_marks_where_a_sequence_leaves_a_cached_path():
    """branch_pos is the G-position at or before the divergence; 0 for extensions and prefixes."""
    cache = _cache()
    base = list(range(20))
    _insert(cache, base)
    assert cache.match_prefix(base[:10] + [77] * 6).branch_pos == 8
    assert cache.match_prefix(base[:11] + [77]).branch_pos == 8
    assert cache.match_prefix(base + [77] * 6).branch_pos == 0  # extends the path
    assert cache.match_prefix(base[:13]).branch_pos == 0  # ends on it
    _insert(cache, base[:12] + [55] * 4)
    assert cache.match_prefix(base[:12] + [66] * 4).branch_pos == 12  # leaves at a node with children


def test_stats_split_kv_hits_from_state_hits():
    """Stats count KV-hit and state-hit tokens separately, FLOPs saved and pool usage."""
    cache = _cache(flops=(2.0, 1.0))
    tokens = list(range(14))
    _insert(cache, tokens, [4])
    cache.match_prefix(tokens + [1])
    cache.match_prefix(tokens, record_stats=False)
    s = cache.stats()
    assert (s.lookups, s.lookup_tokens, s.kv_hit_tokens, s.state_hit_tokens) == (1, 15, 14, 4)
    assert s.flops_saved == 2.0 * 4 + 16.0
    assert (s.pages_cached, s.pages_free, s.checkpoints_cached, s.active_free) == (7, 57, 1, 2)


def test_alloc_evicts_cached_data_but_not_locked_data():
    """alloc_pages / alloc_checkpoint evict unlocked entries when short and return None when all are locked."""
    cache = _cache(pages=8, ckpts=1)
    res = _insert(cache, list(range(16)), [16])
    assert cache.kv_pool.num_free == 0
    cache.lock(res.node)
    assert cache.alloc_pages(1) is None and cache.alloc_checkpoint() is None
    cache.unlock(res.node)
    assert len(cache.alloc_pages(3)) == 3 and cache.stats().checkpoints_cached == 0
    assert cache.alloc_checkpoint() is not None


def test_flush_refuses_while_locked_then_frees_everything():
    """flush raises while a node is locked; afterwards every page and slot is free."""
    cache = make_cache(4, 8)
    engine = ToyEngine(cache, chunk=16)
    engine.run(list(range(40)), [1, 2, 3])
    m = cache.match_prefix(list(range(40)))
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.flush()
    cache.unlock(m.node)
    cache.flush()
    cache.check_integrity()
    assert cache.kv_pool.num_free == cache.kv_pool.num_pages
    assert cache.state_pool.num_free_checkpoints == cache.state_pool.num_checkpoints
    assert cache.state_pool.num_free_active == cache.state_pool.num_active


def test_no_tensor_cache_behaves_like_the_tensor_cache():
    """On the same workload a counting-only cache gives the same matches and stats as one with tensors."""
    rng = random.Random(0)
    base = [rng.randrange(50) for _ in range(200)]
    prompts = [base[: rng.randrange(20, 200)] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
               for _ in range(12)]
    results = []
    for tensors in (True, False):
        cache = make_cache(8, 16, num_tokens=384, num_checkpoints=6, tensors=tensors,
                           config=CacheConfig(eviction="utility"))
        engine = ToyEngine(cache, chunk=32)
        matches = [engine.run(p, [1, 2, 3]).match[:2] for p in prompts]
        cache.check_integrity()
        results.append((matches, cache.stats()))
    assert results[0] == results[1]
    assert results[0][1].evicted_pages > 0 and results[0][1].state_hit_tokens > 0


def test_restore_refuses_a_stale_checkpoint():
    """restore() of a checkpoint the cache no longer holds at that position raises instead of copying."""
    cache = _cache(ckpts=1)
    tokens = list(range(8))
    _insert(cache, tokens, [4])
    m = cache.match_prefix(tokens)
    assert cache.evict(num_checkpoints=1) == (0, 1)
    _insert(cache, list(range(100, 108)), [8])  # the same slot, now at another position
    slot = cache.state_pool.alloc_active()
    with pytest.raises(ValueError, match="not in the cache"):
        cache.restore(m.checkpoint, slot)
    cache.restore(cache.match_prefix(list(range(100, 109))).checkpoint, slot)


def _stash_chunks(cache, tokens, cuts, start_hint: bool):
    """Insert a growing request chunk by chunk (checkpoint at each cut), as the scheduler does."""
    pages, node, ps = [], cache.root, cache.page_size
    cache.lock(node)
    for end in cuts:
        pages += cache.alloc_pages(end // ps - len(pages))
        r = cache.insert(tokens[:end], pages, {end: cache.alloc_checkpoint()}, start=node if start_hint else None)
        pages[r.first_page: r.first_page + len(r.pages)] = r.pages
        cache.relock(node, r.node)
        node = r.node
        cache.check_integrity()
    return node, pages


def test_insert_and_match_from_a_start_node_equal_from_the_root():
    """Walking from the node a request holds gives the same tree, pages, checkpoints and matches
    as walking from the root; relock moves the lock down the path with exact accounting."""
    tokens = list(range(100, 164))
    cuts = [8, 16, 32, 48, 64]
    a, b = _cache(pages=64, ckpts=16), _cache(pages=64, ckpts=16)
    node_a, pages_a = _stash_chunks(a, tokens, cuts, start_hint=True)
    node_b, pages_b = _stash_chunks(b, tokens, cuts, start_hint=False)
    assert pages_a == pages_b and node_a.end == node_b.end == 64
    assert a.stats() == b.stats() and a.stats().pages_locked == 32
    query = tokens + [999]
    ma, mb = a.match_prefix(query, start=node_a), b.match_prefix(query)
    assert (ma.kv_len, ma.state_len, ma.pages, ma.checkpoint) == (mb.kv_len, mb.state_len, mb.pages, mb.checkpoint)
    assert not a.continues(node_a, query) and a.continues(a.root, query)
    a.unlock(node_a)
    a.flush()
    a.check_integrity()
    assert a.kv_pool.num_free == 64


def test_bad_start_node_is_refused():
    """A start node that is unlocked or not on the tokens' path is a ValueError; the tree is intact."""
    cache = _cache()
    r = _insert(cache, list(range(8)), [4])
    with pytest.raises(ValueError, match="start: pass a node the caller holds locked"):
        cache.match_prefix(list(range(9)), start=r.node)
    cache.lock(r.node)
    with pytest.raises(ValueError, match="not on the path"):
        cache.match_prefix([5] * 9, start=r.node)
    cache.unlock(r.node)
    cache.check_integrity()


def test_coarser_checkpoint_grid():
    """checkpoint_grid raises G to a multiple of max(chunk, page); anything else is refused."""
    cache = _cache(page=2, chunk=4, config=CacheConfig(checkpoint_grid=12))
    assert cache.granularity == 12 and cache.admission.granularity == 12
    with pytest.raises(ValueError, match="checkpoint_grid=6 must be a positive multiple of G=4"):
        _cache(page=2, chunk=4, config=CacheConfig(checkpoint_grid=6))


@pytest.mark.parametrize("keeps", [True, False])
def test_split_keeps_or_drops_the_checkpoint(keeps):
    """A node split by a diverging insert keeps its checkpoint (it still ends where it did)
    unless split_keeps_checkpoint is off; then the resend of the first sequence no longer hits."""
    cache = _cache(config=CacheConfig(split_keeps_checkpoint=keeps))
    a = list(range(16))
    _insert(cache, a, [12])
    _insert(cache, a[:8] + [99] * 8)  # shares 8 tokens: splits a's node at 8
    m = cache.match_prefix(a)
    assert m.state_len == (12 if keeps else 0)
    cache.check_integrity()
    assert cache.stats().checkpoints_cached == (1 if keeps else 0)


@pytest.mark.parametrize("use_below", [False, True])
def test_drop_checkpoints_from_the_root_or_walking_up_from_a_deeper_node(use_below):
    """Dropping by position finds the same nodes whether it walks down from the root or up
    from a node below them (what a chunked prefill does once per chunk); a position with
    no node ending there drops nothing."""
    cache = _cache()
    a = list(range(24))
    for end in (8, 16, 24):  # three chunks, a checkpoint at each end
        m = cache.match_prefix(a[:end], record_stats=False)
        pages = list(m.pages) + cache.alloc_pages((end - m.kv_len) // cache.page_size)
        node = cache.insert(a[:end], pages, {end: cache.alloc_checkpoint()}).node
    assert cache.stats().checkpoints_cached == 3 and node.end == 24
    below = node if use_below else None
    assert cache.drop_checkpoints(a, [8, 12], below=below) == 1  # 12: no node ends there
    assert cache.match_prefix(a[:9]).state_len == 0 and cache.match_prefix(a[:17]).state_len == 16
    assert cache.drop_checkpoints(a, [16], below=below) == 1
    assert cache.stats().checkpoints_cached == 1
    cache.check_integrity()
