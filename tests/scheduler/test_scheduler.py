import random

import pytest
import torch

from scheduler import Req, StepOutput, policy_names
from scheduler.policy import cut
from tests.scheduler.helpers import make, prompt, req, run


def _chunks(s, ex, reqs):
    seen = []
    orig = ex.run

    def spy(batch):
        seen.extend(batch.chunks)
        return orig(batch)

    ex.run = spy
    run(s, ex, reqs, on_round=lambda sc: sc.check_integrity())
    return seen


@pytest.mark.parametrize("policy", policy_names())
def test_middle_chunks_end_on_the_grid(policy):
    """Every chunk that does not end a prompt ends on a multiple of G, under every policy."""
    s, ex = make(policy, token_budget=300, target_step=0.02)
    rng = random.Random(1)
    reqs = [req(f"r{i}", prompt(i, rng.randint(1, 900)), new=rng.randint(1, 8), at=i * 0.003) for i in range(20)]
    chunks = _chunks(s, ex, reqs)
    g = s.cache.granularity
    assert any(not c.samples for c in chunks)  # the workload does cut prompts
    assert all(c.end % g == 0 for c in chunks if not c.samples)
    assert all(r.finished and len(r.output_ids) == r.max_new_tokens for r in reqs)
    s.flush_cache()
    assert s.cache.kv_pool.num_free == s.cache.kv_pool.num_pages and s.cache.state_pool.num_free_checkpoints == 64


def test_cut_rule():
    """cut() returns the fill end when reachable, else the last G multiple within reach (>= one G)."""
    assert cut(0, 100, 90, 64) == 90
    assert cut(0, 200, 1000, 64) == 192
    assert cut(128, 10, 1000, 64) == 192  # less than a G step asked: one G step
    assert cut(100, 10, 1000, 64) == 128  # unaligned start: back onto the grid


def test_resend_resumes_from_deepest_checkpoint():
    """An identical resend starts at the last G-position before its final token; nothing a
    checkpoint holds is computed again."""
    s, ex = make("serial")
    p = prompt(7, 1000)
    a = req("a", p)
    run(s, ex, [a])
    before = s.counters["prefill_tokens"]
    b = req("b", p, at=ex.clock.now)
    chunks = _chunks(s, ex, [b])
    assert b.cached_tokens == (len(p) - 1) // 64 * 64 == 960
    assert chunks[0].start == 960 and s.counters["prefill_tokens"] - before == len(p) - 960


def test_with_the_prefix_cache_off_no_state_checkpoint_is_taken():
    """Off, nothing resumes from the cache, so no state is copied: no checkpoint slot is taken at
    a chunk end or a decode grid point (on, the same requests take both kinds), retracted
    requests still complete, and a resend computes its whole prompt again."""
    taken = {}
    for cache in (True, False):
        s, ex = make("budget", pages=30, token_budget=512, decode_reserve=0.25, enable_prefix_cache=cache)
        kinds: list = []

        def counted(*a, alloc=s.cache.alloc_checkpoint, kinds=kinds, **kw):
            kinds.append(kw.get("kind"))
            return alloc(*a, **kw)

        s.cache.alloc_checkpoint = counted
        reqs = [req(f"r{i}", prompt(i, 300), new=300) for i in range(4)]
        run(s, ex, reqs, on_round=lambda sc: sc.check_integrity())
        assert s.counters["retractions"] > 0 and all(r.finished and len(r.output_ids) == 300 for r in reqs)
        taken[cache] = set(kinds)
        s.flush_cache()
        assert s.cache.kv_pool.num_free == 30 and s.cache.state_pool.num_free_active == 16
    assert {"decode", "chunk", "last"} <= taken[True] and taken[False] == set()
    s, ex = make("serial", enable_prefix_cache=False)
    p = prompt(7, 1000)
    run(s, ex, [req("a", p)])
    b = req("b", p, at=ex.clock.now)
    run(s, ex, [b])
    assert b.cached_tokens == 0 and s.counters["prefill_tokens"] == 2 * len(p)


def test_next_turn_resumes_after_previous_output():
    """A conversation's next turn (prompt + output + new text) hits the last G-position of the
    previous turn's prompt + output (the rolling decode checkpoint)."""
    s, ex = make("serial")
    a = req("a", prompt(3, 200), new=70)
    run(s, ex, [a])
    turn2 = req("b", a.all_ids + prompt(4, 30), at=ex.clock.now)
    run(s, ex, [turn2])
    assert turn2.cached_tokens == (200 + 70 - 1) // 64 * 64 == 256


def test_concurrent_identical_prompts_share_work():
    """Checkpoint-aware cutting: a request whose own prefix was checkpointed further along by
    another request jumps ahead instead of recomputing it."""
    s, ex = make("serial", target_step=0.01)
    p = prompt(5, 4000)
    a, b = req("a", p), req("b", p, at=1e-4)
    run(s, ex, [a, b], on_round=lambda sc: sc.check_integrity())
    assert a.finished and b.finished
    assert s.counters["prefill_tokens"] < 1.25 * len(p)


def test_tokens_policy_one_partial_request():
    """Under `tokens` at most one request is partially prefilled at any time."""
    s, ex = make("tokens", token_budget=256)
    reqs = [req(f"r{i}", prompt(i, 700), at=0.0) for i in range(6)]

    def check(sc):
        partial = [r for r in sc.running if 0 < r.prefix_len < r.fill_len or r.cached_tokens < r.extend_end
                   < r.fill_len]
        assert len(partial) <= 1

    run(s, ex, reqs, on_round=check)
    assert all(r.finished for r in reqs)


def test_inflight_middle_chunks_with_lookahead():
    """Scheduling the next round before the previous result returns: cursors run ahead, the
    counter counts both chunks, and processing in order brings it back to zero."""
    s, ex = make("tokens", token_budget=128)
    r = req("r", prompt(1, 1000))
    s.add(r)
    b1 = s.schedule()
    b2 = s.schedule()
    assert [(c.start, c.end) for c in b1.chunks] == [(0, 128)]
    assert [(c.start, c.end) for c in b2.chunks] == [(128, 256)]
    assert r.inflight_middle_chunks == 2 and r.extend_end == 256 and r.prefix_len == 0
    s.process(b1, ex.run(b1))
    assert r.inflight_middle_chunks == 1 and r.prefix_len == 128
    with pytest.raises(ValueError, match="scheduling order"):
        s.process(s.schedule(), StepOutput([]))
    s.process(b2, ex.run(b2))
    assert r.prefix_len == 256 and r.inflight_middle_chunks == 1  # the third round is still out


def test_abort_in_flight_frees_everything():
    """Aborting a request whose chunk is in flight frees its pages and slot once the chunk returns."""
    s, ex = make("tokens", token_budget=128)
    r = req("r", prompt(1, 1000))
    s.add(r)
    b = s.schedule()
    assert s.abort(r) and r.finish_reason == "abort"
    assert s.cache.state_pool.num_free_active == 15  # still held while in flight
    s.process(b, ex.run(b))
    s.check_integrity()
    s.flush_cache()
    assert s.cache.kv_pool.num_free == s.cache.kv_pool.num_pages and s.cache.state_pool.num_free_active == 16
    assert not s.abort(r)


def test_retraction_frees_and_request_completes():
    """With decode space over-committed, the newest request is retracted when KV runs out; its
    pages and slot go back, it is re-admitted from its cached prefix and completes."""
    s, ex = make("budget", pages=30, token_budget=512, decode_reserve=0.25)
    reqs = [req(f"r{i}", prompt(i, 300), new=300, at=0.0) for i in range(4)]
    run(s, ex, reqs, on_round=lambda sc: sc.check_integrity())
    assert s.counters["retractions"] > 0
    assert all(r.finished and len(r.output_ids) == 300 for r in reqs)
    assert any(r.retractions for r in reqs)
    s.flush_cache()
    assert s.cache.kv_pool.num_free == 30 and s.cache.state_pool.num_free_active == 16


def test_request_larger_than_pool_is_rejected():
    """A request that can never fit the KV pool is refused at add() with a clear error."""
    s, _ = make("serial", pages=4)
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        s.add(Req("big", list(range(200)), 100))


def test_each_admission_is_counted_once():
    """A request that waits many rounds for KV room is looked up in the cache's stats once,
    when admitted: two requests, one 128-token state hit, give 2 lookups and 128 hit tokens."""
    s, ex = make("serial", pages=4)  # b fits only once a is done
    shared = prompt(9, 128)
    a = req("a", shared + prompt(1, 1), new=40)  # checkpointed at 128: before its last token
    b = req("b", shared + prompt(2, 70), new=4, at=1e-6)  # waits while a decodes
    run(s, ex, [a, b])
    st = s.cache_stats()
    assert b.cached_tokens == 128
    assert (st.lookups, st.lookup_tokens, st.state_hit_tokens) == (2, len(a.input_ids) + len(b.input_ids), 128)


def test_transient_chunk_checkpoints_live_while_their_request_runs():
    """A running request keeps its deepest chunk-end checkpoint in the cache (for concurrent
    requests with its prefix, and for itself after a retraction), one at a time; when it
    finishes only the checkpoints another rule wants stay (here the resend point at 960)."""
    s, ex = make("tokens", token_budget=256, checkpoints=16)
    p = prompt(4, 1000)
    a = req("a", p, new=2)
    seen = []
    run(s, ex, [a], on_round=lambda sc: seen.append((sc.cache.match_prefix(p, record_stats=False).state_len,
                                                     sc.cache_stats().checkpoints_cached)))
    assert seen[:3] == [(256, 1), (512, 1), (768, 1)]  # the deepest chunk end only, as a's prefill advances
    assert s.cache_stats().checkpoints_cached == 1 and s.cache.match_prefix(p).state_len == 960


def test_a_long_path_of_checkpoints_never_blocks_its_own_continuation():
    """Under one byte budget an agent loop's path fills with its own checkpoints; the next step
    needs only the deepest one, so the others stay evictable and the step is admitted (a lock
    pinning every checkpoint above it once left such a request waiting forever)."""
    from hybridserve.sim import SimClock, SimExecutor
    from scheduler import Scheduler, SchedulerConfig
    from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache
    from tests.scheduler.helpers import COST

    kv = KVPool(60, 64, [{"kv": (1, 4)}])  # one budget of 60 pages of 512 B
    states = StatePool(2, 40, [{"s": ((1024,), torch.float32)}], arena=kv)  # 4 KiB (8 pages) a checkpoint
    cache = StateRadixCache(kv, states, {"kda": 64}, CacheConfig(checkpoint_interval=64))
    clock = SimClock()
    s = Scheduler(cache, SchedulerConfig(policy="serial", max_running=1), COST, clock)
    ex = SimExecutor(COST, clock, token=7)
    context = prompt(1, 64)
    for step in range(12):
        r = req(f"s{step}", context + prompt(100 + step, 64), new=8, at=clock.now)
        run(s, ex, [r])
        assert r.finished and r.cached_tokens >= len(context) - 64, step
        s.check_integrity()
        context = r.all_ids


@pytest.mark.parametrize("shared_len", [512, 700])
def test_a_burst_sharing_a_prefix_computes_it_once(shared_len):
    """Requests arriving together with one system prompt: the first computes the shared part,
    the others wait for it and resume from the checkpoint it writes where they part (its
    share point, at the last G-multiple of the shared part: 512, or 640 of 700), instead of
    each computing the prefix in the same round. With the prefix cache off nobody waits."""
    g, k, own = 64, 6, 100
    system = prompt(1, shared_len)
    for cache in (True, False):
        s, ex = make("serial", target_step=0.5, checkpoint_hedge=None, enable_prefix_cache=cache)
        reqs = [req(f"r{i}", system + prompt(10 + i, own)) for i in range(k)]
        run(s, ex, reqs, on_round=lambda sc: sc.check_integrity())
        assert all(r.finished and len(r.output_ids) == r.max_new_tokens for r in reqs)
        point = shared_len // g * g
        if cache:
            assert s.counters["shared_waits"] >= k - 1
            assert [r.cached_tokens for r in reqs[1:]] == [0] * (k - 1)  # nothing was cached when they came
            assert s.counters["prefill_tokens"] == shared_len + own + (k - 1) * (shared_len + own - point)
        else:
            assert s.counters["shared_waits"] == 0
            assert s.counters["prefill_tokens"] == k * (shared_len + own)


def test_a_waiting_request_copies_one_checkpoint():
    """Requests waiting on a leader adopt each deeper checkpoint it writes (1024 shared tokens, in
    256-token rounds), but one copy into each slot is made, of the checkpoint they resume from,
    when they run: no copy is made for a checkpoint that a deeper one replaces before it runs."""
    s, ex = make("tokens", token_budget=256)
    copies = []
    restore = s.cache.restore
    s.cache.restore = lambda ckpt, slot: (copies.append((ckpt.pos, slot)), restore(ckpt, slot))
    system, k = prompt(1, 1024), 4
    reqs = [req(f"r{i}", system + prompt(10 + i, 100)) for i in range(k)]
    run(s, ex, reqs, on_round=lambda sc: sc.check_integrity())
    assert all(r.finished for r in reqs) and s.counters["shared_waits"] > k
    assert sorted(pos for pos, _ in copies) == [1024] * (k - 1)


def test_requests_that_part_early_do_not_wait():
    """Requests whose first G tokens differ share nothing worth waiting for: all are planned."""
    s, ex = make("serial", target_step=0.5)
    reqs = [req(f"r{i}", prompt(20 + i, 300)) for i in range(4)]
    run(s, ex, reqs)
    assert s.counters["shared_waits"] == 0 and s.counters["prefill_tokens"] == 4 * 300


def test_host_hits_load_when_the_copy_is_cheaper_than_recompute():
    """A prefix pushed to the host tier comes back when bytes / host link beats the predicted
    prefill it saves (the copy's time is charged to the next round), and is recomputed when
    the link is priced slower; either way the request's tokens and the cache stay consistent."""
    import dataclasses

    from hybridserve.sim import SimClock, SimExecutor
    from scheduler import Scheduler, SchedulerConfig
    from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache
    from tests.scheduler.helpers import COST, prompt, req

    def run(link: float):
        kv = KVPool(40, 64, [{"kv": (1, 4)}])  # 40 pages of 512 B
        cache = StateRadixCache(kv, StatePool(2, 4, [{"s": ((512,), torch.float32)}], arena=kv), {"kda": 64},
                                CacheConfig(), host=KVPool(400, 64, [{"kv": (1, 4)}]))
        cost = dataclasses.replace(COST, host_bytes_per_s=link)
        clock = SimClock()
        s, ex = Scheduler(cache, SchedulerConfig(policy="serial", max_running=2), cost, clock), SimExecutor(cost, clock)
        target = prompt(1, 640)
        copies = []
        for i, p in enumerate([target] + [prompt(10 + i, 640) for i in range(3)] + [target]):
            r = req(f"r{i}", p, new=2)
            s.add(r)
            while s.has_work():
                b = s.schedule()
                copies.append(b.copy_s)
                s.process(b, ex.run(b))
            cache.check_integrity()
        return s, cache, r, copies

    fast, cache, last, copies = run(50e9)
    assert fast.counters["host_loads"] == 1 and cache.stats().host_hit_tokens > 0
    assert last.cached_tokens == 576 and max(copies) > 0
    slow, cache, last, _ = run(1.0)  # one byte per second: recomputing is cheaper
    assert slow.counters["host_loads"] == 0 and slow.counters["host_recomputes"] == 1 and last.cached_tokens == 0
