"""Admission under memory pressure: a request that does not fit does not block the ones that
do (but is not starved), a waiting request times out, a full decode reservation never
retracts, retraction makes progress, and cache hits are reported for the prompt only."""
from __future__ import annotations

import pytest

from tests.scheduler.helpers import make, prompt, req, run


def _finished_at(r):
    return r.token_times[-1]


def _big_and_small(**kw):
    """40 pages of 64 tokens: each `big` (25 pages) fits alone, two do not; `small` fits beside one."""
    s, ex = make("serial", pages=40, **kw)
    big = [req(f"big{i}", prompt(i, 64), new=1500, at=0.0) for i in range(2)]
    return s, ex, big


def test_a_small_request_passes_one_that_does_not_fit():
    """Two requests that cannot run together and a 4-token one behind them: the small one is
    admitted beside the first (passing the second, which waits for room) and finishes long
    before the first does; all three complete."""
    s, ex, big = _big_and_small()
    small = req("small", prompt(9, 4), new=4, at=1e-4)
    run(s, ex, big + [small], on_round=lambda sc: sc.check_integrity())
    assert all(r.finish_reason == "length" for r in big + [small])
    assert _finished_at(small) < 0.1 * _finished_at(big[0])
    assert big[1].first_token_at > _finished_at(big[0])  # it did wait for the room
    s.flush_cache()
    assert s.cache.kv_pool.num_free == 40


def test_a_passed_request_is_not_starved():
    """Once a waiting request has been passed for `skip_ahead_wait` seconds, admission holds for
    it: requests arriving later wait until it is admitted, and it is admitted as soon as the
    running one leaves room."""
    s, ex, big = _big_and_small(skip_ahead_wait=0.1)
    smalls = [req(f"s{i}", prompt(20 + i, 4), new=4, at=0.05 * i + 1e-4) for i in range(30)]
    run(s, ex, big + smalls)
    early = [r for r in smalls if r.arrival < 0.1]
    late = [r for r in smalls if r.arrival > 0.15]
    assert early and late
    assert all(_finished_at(r) < _finished_at(big[0]) for r in early)  # passed it while it was young
    assert all(r.first_token_at >= big[1].first_token_at for r in late)  # then it held the queue
    assert big[1].first_token_at - _finished_at(big[0]) < 0.01
    assert all(r.finish_reason == "length" for r in big + smalls)


def test_strict_order_when_skipping_is_off():
    """skip_ahead_wait=0 keeps admission in policy order: the small request waits behind."""
    s, ex, big = _big_and_small(skip_ahead_wait=0)
    small = req("small", prompt(9, 4), new=4, at=1e-4)
    run(s, ex, big + [small])
    assert small.first_token_at >= big[1].first_token_at


def test_a_request_waiting_past_queue_timeout_ends():
    """A request not admitted within `queue_timeout` seconds is finished with finish_reason
    queue_timeout (no tokens, nothing held), reported once by pop_ended(); the others are served."""
    s, ex, big = _big_and_small(queue_timeout=0.5)
    small = req("small", prompt(9, 4), new=4, at=1e-4)
    ended = []
    run(s, ex, big + [small], on_round=lambda sc: ended.extend(sc.pop_ended()))
    assert big[1].finish_reason == "queue_timeout" and big[1].output_ids == [] and big[1].state_slot is None
    assert ended == [big[1]]
    assert big[0].finish_reason == small.finish_reason == "length"
    s.check_integrity()
    s.flush_cache()
    assert s.cache.kv_pool.num_free == 40 and s.cache.state_pool.num_free_active == 16


def _reservation_holds(sc):
    """Every running request's remaining pages (fill + all of its decode) fit what is free or evictable."""
    page = sc.cache.page_size
    left = sum(max(0, -(-r.max_len // page) - len(r.kv_pages)) for r in sc.running)
    assert left <= sc.cache.free_pages + sc.cache.evictable_pages


def test_full_decode_reserve_never_retracts():
    """decode_reserve=1 admits only what surely fits: the reservation of a decoding request
    covers all of its remaining output, so no request is ever retracted."""
    s, ex = make("serial", pages=30, decode_reserve=1.0)
    reqs = [req(f"r{i}", prompt(i, 64), new=640, at=0.0) for i in range(6)]
    run(s, ex, reqs, on_round=_reservation_holds)
    assert s.counters["retractions"] == 0
    assert all(r.finish_reason == "length" for r in reqs)


@pytest.mark.parametrize("reserve", [0.25, 0.5, 0.75])
def test_retraction_makes_progress(reserve):
    """Under `tokens` without mixed batches and an over-committed decode reserve, two requests
    that cannot both finish in the pool do not retract each other in turn: a request only
    retracts ones admitted after it, both finish, with few retractions and at most one
    recompute of a request each."""
    s, ex = make("tokens", pages=8, token_budget=256, decode_reserve=reserve)
    reqs = [req(f"r{i}", prompt(i, 20), new=400, at=0.0) for i in range(2)]
    run(s, ex, reqs, on_round=lambda sc: sc.check_integrity(), stop=lambda: s.counters["rounds"] > 5000)
    assert all(r.finish_reason == "length" for r in reqs)
    assert s.counters["retractions"] <= 2
    assert s.counters["prefill_tokens"] <= 40 + s.counters["retractions"] * 420  # one redo each at most


@pytest.mark.parametrize("kw", [{}, {"decode_steps_between_prefills": 2}, {"mixed_chunk": True}])
def test_retraction_makes_progress_among_three(kw):
    """Three requests of different lengths under `tokens`, every decode mode: all finish, each
    recomputed at most once per retraction; decode turns owed while the only running request
    is refilling after a retraction do not stall the round."""
    s, ex = make("tokens", pages=8, token_budget=256, decode_reserve=0.25, **kw)
    reqs = [req(f"r{i}", prompt(i, 20 + 30 * i), new=400, at=0.0) for i in range(3)]
    run(s, ex, reqs, on_round=lambda sc: sc.check_integrity(), stop=lambda: s.counters["rounds"] > 5000)
    assert all(r.finish_reason == "length" for r in reqs)
    assert s.counters["retractions"] <= 4
    assert s.counters["prefill_tokens"] <= 150 + s.counters["retractions"] * 480


def test_cached_tokens_count_the_prompt_only():
    """A retracted request resumes from its own prompt + output in the cache; cached_tokens
    (the usage's prompt_tokens_details) still counts only prompt tokens served from the cache."""
    s, ex = make("budget", pages=30, token_budget=512, decode_reserve=0.25)
    reqs = [req(f"r{i}", prompt(i, n), new=600, at=0.0) for i, n in enumerate([20, 52, 36, 44])]
    starts = []
    orig = ex.run
    ex.run = lambda batch: starts.extend((c.req, c.start) for c in batch.chunks) or orig(batch)
    run(s, ex, reqs)
    assert any(start > r.prompt_len for r, start in starts)  # a retracted request resumed past its prompt
    assert all(r.cached_tokens <= r.prompt_len for r in reqs)
    assert all(r.finish_reason == "length" for r in reqs)
