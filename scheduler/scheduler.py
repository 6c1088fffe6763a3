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

import itertools
from collections import deque
from typing import Callable

from scheduler.batch import Batch, Chunk, StepOutput
from scheduler.cache_manager import CacheManager
from scheduler.cost import BatchShape, CostModel
from scheduler.policy import PolicyConfig, plan_round
from scheduler.request import Req, Status
from state_cache import StateRadixCache


class Scheduler:
    def __init__(self, cache: StateRadixCache, policy: PolicyConfig, cost: CostModel, clock: Callable[[], float],
                 max_running: int = 64, decode_reserve: float = 1.0, checkpoint_interval: int | None = None):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        if not 0 < decode_reserve <= 1:
            raise ValueError(f"decode_reserve must be in (0, 1], got {decode_reserve}")
        if policy.name in ("tokens", "budget") and policy.token_budget < cache.granularity:
            raise ValueError(f"token_budget={policy.token_budget} is below the checkpoint grid G={cache.granularity}")
        self.mem = CacheManager(cache, checkpoint_interval)
        self.policy, self.cost, self.clock = policy, cost, clock
        self.max_running, self.decode_reserve = max_running, decode_reserve
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.inflight: deque[Batch] = deque()
        self._order = itertools.count()
        self._admitted: dict[Req, int] = {}
        self._decode_turns = 0  # tokens policy: decode-only rounds still owed
        self.counters = dict(prefill_tokens=0, decode_tokens=0, rounds=0, retractions=0)

    # -- requests ------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        """Queue a request; ValueError if it can never fit the KV pool."""
        need = self.mem.pages_for(req.max_len)
        if need > self.mem.kv.num_pages:
            raise ValueError(f"prompt + max_new_tokens = {req.max_len} tokens exceeds the KV pool's capacity "
                             f"of {self.mem.kv.num_pages * self.mem.page_size} tokens")
        req.arrival = req.arrival or self.clock()
        req.deadline = req.arrival + self.policy.ttft_slo(req.prompt_len)
        req.fill_len = req.prompt_len
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
            self.mem.release(req)

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
        prefills = self._order_prefills([r for r in prefills if r.remaining_fill > 0])
        plan = plan_round(self.policy, self.cost, self.mem.g, prefills, decodes, now,
                          prefill_turn=self._decode_turns == 0)
        placed: set[Req] = set()  # in this round: never a retraction victim
        decodes = []
        for r in plan.decodes:
            if r.state_slot is not None and self._room(r, r.prefix_len + 1, placed):
                decodes.append(r)
                placed.add(r)
        chunks = []
        for pick in plan.chunks:
            if pick.req.state_slot is None or not self._room(pick.req, pick.end, placed):
                break
            placed.add(pick.req)
            chunks.append(Chunk(pick.req, pick.start, pick.end,
                                self.mem.chunk_checkpoints(pick.req, pick.start, pick.end)))
            pick.req.extend_end = pick.end
            pick.req.inflight_middle_chunks += pick.end < pick.req.fill_len
        if not chunks and not decodes:
            return None
        self._decode_turns = (self.policy.decode_steps_between_prefills if chunks else max(0, self._decode_turns - 1))
        shape = BatchShape([(c.start, c.end - c.start) for c in chunks], [r.prefix_len for r in decodes])
        batch = Batch(chunks, decodes, shape, self.cost.step_time(shape))
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
            self.mem.stash(r, c.end, c.checkpoints)
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
            self.mem.after_decode(r)
            self._append(r, sampled[id(r)], now)
            changed.append(r)
        return changed

    # -- helpers -------------------------------------------------------------------------

    def _append(self, r: Req, token: int, now: float) -> None:
        r.append(token)
        r.token_times.append(now)
        if r.first_token_at is None:
            r.first_token_at = now
        if token in r.stop_token_ids:
            self.finish(r, "stop")
        elif len(r.output_ids) >= r.max_new_tokens:
            self.finish(r, "length")

    def _admit(self) -> None:
        order = sorted(self.waiting, key=lambda r: r.deadline) if self.policy.name == "serial+deadline" \
            else list(self.waiting)
        for req in order:
            if len(self.running) >= self.max_running:
                break
            req.fill_len = len(req.all_ids)
            m = self.mem.match(req)
            self.mem.cache.lock(m.node)  # the hit pages are not ours to count as evictable
            need = self.mem.pages_for(req.fill_len + req.max_new_tokens - len(req.output_ids)) - len(m.pages)
            room = self.mem.kv.num_free + self.mem.cache.evictable_pages - self._reserved()
            self.mem.cache.unlock(m.node)
            if need * self.decode_reserve > room or not self.mem.admit(req, m):
                break  # first come first served: later requests wait behind this one
            self.waiting.remove(req)
            req.status = Status.PREFILL
            self.running.append(req)
            self._admitted[req] = next(self._order)

    def _reserved(self) -> int:
        return sum(self.mem.future_pages(r, self.decode_reserve) for r in self.running)

    def _resume_from_cache(self, r: Req) -> None:
        """Checkpoint-aware cutting: jump ahead if a deeper checkpoint of r's own prefix exists
        (another request put it there); the match walks from the node r holds."""
        if not self.mem.deeper_cached(r):
            return
        m = self.mem.match(r, record=False)
        if m.state_len > r.prefix_len:
            self.mem.adopt(r, m)

    def _order_prefills(self, prefills: list[Req]) -> list[Req]:
        if self.policy.name == "serial+deadline":
            return sorted(prefills, key=lambda r: r.deadline)
        # partially prefilled first (at most one under `tokens`), then arrival order
        return sorted(prefills, key=lambda r: (r.extend_end == r.cached_tokens, self._admitted[r]))

    def _room(self, r: Req, tokens: int, placed: set[Req]) -> bool:
        """Pages for r's first `tokens` positions, retracting the newest idle running requests
        (not r, not already placed in this round) while the pool is short."""
        while not self.mem.ensure_pages(r, tokens):
            busy = self._busy_set()
            victims = [v for v in self.running if v is not r and v not in placed and v not in busy]
            if not victims:
                return False
            victim = max(victims, key=self._admitted.__getitem__)
            self.running.remove(victim)
            del self._admitted[victim]
            self.mem.release(victim)  # its computed prefix stays in the tree where it can
            victim.status, victim.prefix_len, victim.extend_end = Status.WAITING, 0, 0
            victim.retractions += 1
            self.counters["retractions"] += 1
            self.waiting.appendleft(victim)
        return True

    def _busy_set(self) -> set[Req]:
        return {x for b in self.inflight for x in [c.req for c in b.chunks] + b.decodes}

    def _busy(self, r: Req) -> bool:
        return r in self._busy_set()

    def _release_if_idle(self, r: Req) -> None:
        if not self._busy(r):
            self.mem.release(r)

    def _free_checkpoints(self, checkpoints) -> None:
        for _, slot in checkpoints:
            self.mem.states.free(slot)

    def check_integrity(self) -> None:
        """Pools and tree consistent, and every running request holds live pages and a slot."""
        self.mem.cache.check_integrity()
        for r in self.running:
            if r.state_slot is None or any(self.mem.kv.refcount(p) < 1 for p in r.kv_pages):
                raise RuntimeError(f"request {r.rid}: lost its slot or a page")
