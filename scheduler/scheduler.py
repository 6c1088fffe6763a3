"""Scheduler: waiting and running queues, one round at a time.

    schedule()  admit waiting requests (cache match + restore), plan the round under the
                policy, give chunks their pages and checkpoint slots  -> Batch
    process()   stash each chunk (checkpoint + insert + cursor), append sampled tokens,
                checkpoint decode states on the grid, finish requests  -> changed requests
A round may be scheduled before the previous one is processed: cursors run ahead
(`extend_end`), and a request with work in flight gets no decode row until it returns.
No tensor is touched here; the clock is injected, so the `sim` executor runs this code as is.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from typing import Callable

from scheduler.batch import Batch, Chunk, StepOutput
from scheduler.cache_manager import CacheManager
from scheduler.config import SchedulerConfig
from scheduler.cost import BatchShape, CostModel
from scheduler.policy import Plan, scheduling_policy
from scheduler.request import Req, Status
from state_cache import CacheStats, MatchResult, PrefixCache

log = logging.getLogger(__name__)


class Scheduler:
    """The policy (`config.policy`, a registered SchedulingPolicy) orders and plans; the
    cache manager moves pages, slots and checkpoints between requests and the cache."""

    def __init__(self, cache: PrefixCache, config: SchedulerConfig, cost: CostModel, clock: Callable[[], float]):
        self.config, self.cost, self.clock = config, cost, clock
        self.cache_manager = CacheManager(cache, self._reserved)
        self.policy = scheduling_policy(config, cost, cache.granularity if config.aligned_cuts else 1)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.inflight: deque[Batch] = deque()
        self._order = itertools.count()
        self._admitted: dict[Req, int] = {}  # running -> seniority (order of first admission)
        self._ended: list[Req] = []  # finished here, outside process() (queue timeout): for pop_ended()
        self.counters = dict(prefill_tokens=0, decode_tokens=0, rounds=0, retractions=0, shared_waits=0,
                             host_loads=0, host_recomputes=0)
        self._moved = 0  # host-tier bytes moved up to the last round (priced into the next one)

    @property
    def cache(self) -> PrefixCache:
        return self.cache_manager.cache

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request can ever hold (the whole KV pool)."""
        return self.cache.capacity_pages * self.cache.page_size

    # -- requests ------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request; ValueError if it can never fit the KV pool."""
        if req.max_len > self.kv_capacity_tokens:
            raise ValueError(f"prompt + max_new_tokens = {req.max_len} tokens exceeds the KV pool's capacity "
                             f"of {self.kv_capacity_tokens} tokens")
        if req.arrival is None:
            req.arrival = self.clock()
        if req.deadline is None:
            req.deadline = req.arrival + self.config.ttft_slo(req.prompt_len)
        req.fill_len = req.prompt_len
        req.queued_at = self.clock()
        self.waiting.append(req)

    def abort(self, req: Req) -> bool:
        """Stop req now (its in-flight work is dropped when it returns); False if already done."""
        if req.finished:
            return False
        self.finish(req, "abort")
        return True

    def finish(self, req: Req, reason: str) -> None:
        """End req (also for engine-side stops such as stop strings) and free what it holds."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self._admitted:
            self.running.remove(req)
            del self._admitted[req]
        req.status, req.finish_reason = Status.FINISHED, reason
        if not self._busy(req):
            self.cache_manager.release(req)

    def fail_inflight(self) -> list[Req]:
        """After the executor failed: drop every round in flight and abort its requests
        (their pages, active slots and the rounds' checkpoint slots are freed)."""
        batches = list(self.inflight)
        self.inflight.clear()
        reqs = list(dict.fromkeys(r for b in batches for r in [c.req for c in b.chunks] + b.decodes))
        for c in (c for b in batches for c in b.chunks):
            c.req.inflight_middle_chunks -= not c.samples
            self._free_checkpoints(c.checkpoints)
        for r in reqs:
            if r.finished:  # ended while in flight: its release was deferred to now
                self.cache_manager.release(r)
            else:
                self.finish(r, "abort")
        return reqs

    def pop_ended(self) -> list[Req]:
        """Requests the scheduler finished on its own since the last call (queue timeout), for
        the caller to report; process() returns the others."""
        ended, self._ended = self._ended, []
        return ended

    def flush_cache(self) -> None:
        """Drop everything the cache holds (RuntimeError while requests hold parts of it)."""
        self.cache.flush()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    # -- one round -----------------------------------------------------------------------

    def schedule(self) -> Batch | None:
        now = self.clock()
        self._admit()
        busy = self._busy_set()
        prefills = [r for r in self.running if r.status is Status.PREFILL and r.remaining_fill > 0]
        decodes = [r for r in self.running if r.status is Status.DECODE and r not in busy]
        for r in prefills:
            if r not in busy and r.prefix_len == r.extend_end:
                self._resume_from_cache(r)
        prefills = self.policy.prefill_order([r for r in prefills if r.remaining_fill > 0], self._admitted)
        prefills = self._share(prefills, busy)
        plan = self.policy.plan(prefills, decodes, now)
        chunks, rows = self._place(plan)
        if plan.chunks and not chunks and not rows:  # no planned chunk got pages: run the decode rows it left out
            chunks, rows = self._place(self.policy.plan([], decodes, now))
        if not chunks and not rows:
            return None
        for c in chunks:
            self.cache_manager.restore(c.req)
        self.policy.scheduled(bool(chunks))
        shape = BatchShape([(c.start, c.end - c.start) for c in chunks], [r.prefix_len for r in rows])
        batch = Batch(chunks, rows, shape, self.cost.step_time(shape), self._copy_time())
        self.inflight.append(batch)
        self.counters["rounds"] += 1
        return batch

    def process(self, batch: Batch, out: StepOutput) -> list[Req]:
        """Apply a round's result (rounds are processed in the order they were scheduled)."""
        if not self.inflight or self.inflight[0] is not batch:
            raise ValueError("batch: results must be processed in scheduling order")
        self.inflight.popleft()
        if len(out.tokens) != len(batch.sampling_reqs):
            raise ValueError(f"out: {len(out.tokens)} tokens for {len(batch.sampling_reqs)} sampling rows")
        now = self.clock()
        sampled = dict(zip(map(id, batch.sampling_reqs), out.tokens))
        changed = []
        for c in batch.chunks:
            r = c.req
            r.inflight_middle_chunks -= not c.samples
            self.counters["prefill_tokens"] += c.end - c.start
            if r.finished:  # aborted while in flight
                self._free_checkpoints(c.checkpoints)
                self._release_if_idle(r)
                continue
            r.prefix_len = c.end
            self.cache_manager.stash(r, c.end, c.checkpoints)
            if c.samples:
                r.status = Status.DECODE
                self._append(r, sampled[id(r)], now)
                changed.append(r)
        for r in batch.decodes:
            self.counters["decode_tokens"] += 1
            if r.finished:
                self._release_if_idle(r)
                continue
            r.prefix_len += 1
            self.cache_manager.after_decode(r)
            self._append(r, sampled[id(r)], now)
            changed.append(r)
        return changed

    # -- helpers -------------------------------------------------------------------------

    def _share(self, prefills: list[Req], busy: set[Req]) -> list[Req]:
        """In-round prefix sharing. Requests that would compute the same next G tokens from the
        same point (the tree holds nothing deeper for them yet: a burst of prompts with one
        system prompt) are planned one at a time: the first in order leads, the others wait
        while it computes (or has in flight) what they share, then resume from the checkpoint
        it writes where their prompts part (its `share_points`), as `_resume_from_cache` does.
        Without this, a round admitting k such requests computes the shared prefix k times."""
        if not self.cache_manager.hits:
            return prefills
        g = self.cache_manager.g
        leaders: dict[tuple, Req] = {}
        for r in self.running:  # chunks in flight from their prefix: they lead whoever follows
            if r in busy and r.status is Status.PREFILL and r.extend_end - r.prefix_len >= g:
                leaders.setdefault((r.prefix_len, tuple(r.all_ids[r.prefix_len:r.prefix_len + g])), r)
        kept = []
        for r in prefills:
            start = r.prefix_len
            if r in busy or r.extend_end != start or r.fill_len - start <= g:
                kept.append(r)  # mid-flight, or less than a G step left: nothing to wait for
                continue
            key = (start, tuple(r.all_ids[start:start + g]))
            lead = leaders.get(key)
            if lead is None or lead.all_ids[:start] != r.all_ids[:start]:
                leaders.setdefault(key, r)
                kept.append(r)
                continue
            shared = _common_prefix(lead.all_ids, r.all_ids, start + g, r.fill_len - 1) // g * g
            if shared > lead.prefix_len:
                lead.share_points.add(shared)
            self.counters["shared_waits"] += 1
        return kept

    def _append(self, r: Req, token: int, now: float) -> None:
        r.append(token)
        r.token_times.append(now)
        if r.first_token_at is None:
            r.first_token_at = now
        if token in r.stop_token_ids:
            self.finish(r, "stop")
        elif len(r.output_ids) >= r.max_new_tokens:
            self.finish(r, "length")

    def _place(self, plan: Plan) -> tuple[list[Chunk], list[Req]]:
        """Pages for the plan's decode rows, then its chunks in order (up to the first that gets
        none); cursors advance for the chunks placed."""
        placed: set[Req] = set()  # in this round: never a retraction victim
        rows = []
        for r in plan.decodes:
            if r.state_slot is not None and self._room(r, r.prefix_len + 1, placed):
                rows.append(r)
                placed.add(r)
        chunks = []
        for pick in plan.chunks:
            if pick.req.state_slot is None or not self._room(pick.req, pick.end, placed):
                break
            placed.add(pick.req)
            chunks.append(Chunk(pick.req, pick.start, pick.end,
                                self.cache_manager.chunk_checkpoints(pick.req, pick.start, pick.end)))
            pick.req.extend_end = pick.end
            pick.req.inflight_middle_chunks += pick.end < pick.req.fill_len
        return chunks, rows

    def _admit(self) -> None:
        """Admit waiting requests in policy order while each fits: pages for its whole remaining
        fill plus decode_reserve x its new tokens, beside what running requests may still
        allocate. One that does not fit is passed by later ones that do until it has been
        blocked for skip_ahead_wait seconds; then nothing behind it is admitted before it."""
        cm, now = self.cache_manager, self.clock()
        self._expire(now)
        for req in self.policy.admission_order(self.waiting):
            if len(self.running) >= self.config.max_running:
                break
            req.fill_len = len(req.all_ids)
            m = self._from_host(req, cm.match(req))
            cm.cache.lock(m.node)  # the hit pages are not ours to count as evictable
            need = cm.future_pages(req, self.config.decode_reserve, held=len(m.pages))
            room = cm.cache.free_pages + cm.cache.evictable_pages - self._reserved()
            cm.cache.unlock(m.node)
            if need > room:
                if req.blocked_since is None:
                    req.blocked_since = now
                if room <= 0 or now - req.blocked_since >= self.config.skip_ahead_wait:
                    break  # nothing fits, or it has been passed long enough: hold for it
                continue  # skip ahead
            if not cm.admit(req, m):
                break  # no active slot for anyone
            self.waiting.remove(req)
            req.status, req.blocked_since = Status.PREFILL, None
            if req.seniority is None:
                req.seniority = next(self._order)
            self._admitted[req] = req.seniority
            bisect.insort(self.running, req, key=self._admitted.__getitem__)  # seniors are placed first

    def _from_host(self, req: Req, m: MatchResult) -> MatchResult:
        """Load m's host-tier hit back when the copy (its bytes over the host link) is cheaper
        than recomputing the prefill it saves (one segment [state_len, host_len)); the match then."""
        if m.host_len <= m.state_len:
            return m
        recompute = self.cost.step_time(BatchShape([(m.state_len, m.host_len - m.state_len)]))
        if self.cost.copy_time(m.host_bytes) >= recompute:
            self.counters["host_recomputes"] += 1
            return m
        if self.cache.load(m):
            self.counters["host_loads"] += 1
            return self.cache_manager.match(req)
        return m

    def _copy_time(self) -> float:
        """Seconds of host-tier traffic (both directions) since the last round."""
        moved, self._moved = self._moved, self.cache.host_bytes_moved
        return self.cost.copy_time(self._moved - moved) if self._moved > moved and self.cost.host_bytes_per_s else 0.0

    def _expire(self, now: float) -> None:
        """End the waiting requests queued longer than queue_timeout."""
        timeout = self.config.queue_timeout
        if timeout is None:
            return
        for req in [r for r in self.waiting if now - r.queued_at > timeout]:
            self.finish(req, "queue_timeout")
            self._ended.append(req)

    def _reserved(self) -> int:
        return sum(self.cache_manager.future_pages(r, self.config.decode_reserve) for r in self.running)

    def _resume_from_cache(self, r: Req) -> None:
        """Checkpoint-aware cutting: jump ahead if a deeper checkpoint of r's own prefix exists
        (another request put it there); the match walks from the node r holds."""
        if not self.cache_manager.deeper_cached(r):
            return
        m = self.cache_manager.match(r)
        if m.state_len > r.prefix_len:
            self.cache_manager.adopt(r, m)

    def _room(self, r: Req, tokens: int, placed: set[Req]) -> bool:
        """Pages for r's first `tokens` positions, retracting the most junior idle running
        requests admitted after r (not already placed in this round) while the pool is short.
        Seniority is kept across retractions, so two requests never retract each other in turn
        and the most senior one is never retracted."""
        senior = self._admitted[r]
        while not self.cache_manager.ensure_pages(r, tokens):
            busy = self._busy_set()
            victims = [v for v in self.running if self._admitted[v] > senior and v not in placed and v not in busy]
            if not victims:
                return False
            victim = max(victims, key=self._admitted.__getitem__)
            self.running.remove(victim)
            del self._admitted[victim]
            self.cache_manager.release(victim)  # its computed prefix stays in the tree where it can
            victim.status, victim.prefix_len, victim.extend_end = Status.WAITING, 0, 0
            victim.queued_at = self.clock()
            victim.retractions += 1
            self.counters["retractions"] += 1
            log.info("retracted %s (%d tokens computed) to make room for %s", victim.rid, len(victim.all_ids), r.rid)
            self.waiting.appendleft(victim)
        return True

    def _busy_set(self) -> set[Req]:
        return {x for b in self.inflight for x in [c.req for c in b.chunks] + b.decodes}

    def _busy(self, r: Req) -> bool:
        return r in self._busy_set()

    def _release_if_idle(self, r: Req) -> None:
        if not self._busy(r):
            self.cache_manager.release(r)

    def _free_checkpoints(self, checkpoints) -> None:
        for _, slot in checkpoints:
            self.cache_manager.states.free(slot)

    def check_integrity(self) -> None:
        """Pools and tree consistent, and every running request holds live pages and a slot."""
        self.cache.check_integrity()
        for r in self.running:
            if r.state_slot is None or any(self.cache.kv_pool.refcount(p) < 1 for p in r.kv_pages):
                raise RuntimeError(f"request {r.rid}: lost its slot or a page")


def _common_prefix(a: list[int], b: list[int], known: int, limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`, given the first `known` agree."""
    lo, hi = known, min(limit, len(a), len(b))
    if lo >= hi:
        return min(lo, hi)
    while lo < hi:  # slices compare in C: O(log n) of them
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
