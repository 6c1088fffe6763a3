"""Scheduling policies are registered objects; the scheduler codes against the PrefixCache
contract only; sentinels mean what they say (arrival, deadline, failed rounds)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from scheduler import CostModel, Req, Scheduler, SchedulerConfig, policy_names, register
from scheduler.policy import _POLICIES, Plan, SchedulingPolicy, _fill_tokens
from state_cache import CacheConfig, KVPool, PrefixCache, StatePool, StateRadixCache
from tests.scheduler.helpers import COST, make, prompt, req, run

ROOT = Path(__file__).resolve().parents[2]


def test_unknown_policy_lists_the_known_ones():
    """An unknown policy name is refused where the config is made, naming every registered policy."""
    assert policy_names() == ["tokens", "budget", "serial", "serial+deadline"]
    with pytest.raises(ValueError, match=r"policy: unknown scheduling policy 'fifo'; known: \['tokens', 'budget'"):
        SchedulerConfig(policy="fifo")


def test_a_registered_policy_plugs_in_without_touching_the_scheduler():
    """A new policy registered by name (here: newest request first, 128 tokens a round) is
    used by the unchanged scheduler for admission order and round planning."""

    @register("newest-first")
    class NewestFirst(SchedulingPolicy):
        def admission_order(self, waiting):
            return sorted(waiting, key=lambda r: -r.arrival)

        def prefill_order(self, prefills, admitted):
            return sorted(prefills, key=lambda r: -r.arrival)

        def plan(self, prefills, decodes, now):
            return Plan(_fill_tokens(prefills, 128, self.g, one_partial=True), list(decodes))

    try:
        s, ex = make("newest-first", max_running=1)
        reqs = [req(f"r{i}", prompt(i, 300), at=0.0 + i * 1e-9) for i in range(3)]
        for r in reqs:
            s.add(r)
        run(s, ex, [])
        assert all(r.finished for r in reqs)
        firsts = sorted(reqs, key=lambda r: r.first_token_at)
        assert [r.rid for r in firsts] == ["r2", "r1", "r0"]
        assert isinstance(s.policy, NewestFirst) and s.policy.name == "newest-first"
    finally:
        del _POLICIES["newest-first"]


def test_no_policy_name_branches_outside_the_registry():
    """No module compares a policy's name to a literal: behaviour is the policy object's."""
    names = "|".join(re.escape(n) for n in policy_names())
    branch = re.compile(rf"""(==|!=|\bin\b)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = []
    for package in ("hybridserve", "scheduler", "state_cache", "models", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if branch.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


class ContractOnly(PrefixCache):
    """A StateRadixCache seen only through the PrefixCache contract: any other attribute raises."""

    def __init__(self, inner: StateRadixCache):
        self._inner = inner
        self.kv_pool, self.state_pool, self.page_size = inner.kv_pool, inner.state_pool, inner.page_size
        self.config, self.admission = inner.config, inner.admission


def _forward(name: str):
    """The contract member `name` of PrefixCache, answered by the wrapped cache."""
    if isinstance(getattr(PrefixCache, name), property):
        return property(lambda self: getattr(self._inner, name))
    return lambda self, *a, **k: getattr(self._inner, name)(*a, **k)


for _name in PrefixCache.__abstractmethods__:
    setattr(ContractOnly, _name, _forward(_name))
ContractOnly.__abstractmethods__ = frozenset()


@pytest.mark.parametrize("policy", policy_names())
def test_scheduler_needs_only_the_cache_contract(policy):
    """The scheduler and its cache manager run a shared-prefix workload (hits, chunked prefill,
    decode checkpoints, eviction) through a cache that exposes nothing but PrefixCache."""
    inner = StateRadixCache(KVPool(64, 64), StatePool(4, 6), {"kda": 64}, CacheConfig())
    from hybridserve.sim import SimClock, SimExecutor, simulate

    clock = SimClock()
    s = Scheduler(ContractOnly(inner), SchedulerConfig(policy=policy, token_budget=256, max_running=3,
                                                       target_step=0.01), COST, clock)
    shared = prompt(1, 700)
    reqs = [Req(f"r{i}", shared + prompt(10 + i, 50 + 40 * i), 70, arrival=i * 0.01) for i in range(6)]
    simulate(s, SimExecutor(COST, clock), reqs, on_round=lambda sc: sc.check_integrity())
    assert all(r.finished for r in reqs) and sum(r.cached_tokens for r in reqs) > 0
    s.flush_cache()
    assert inner.kv_pool.num_free == 64 and inner.state_pool.num_free_checkpoints == 6


def test_arrival_at_zero_is_kept_and_none_is_stamped():
    """A request that arrives at t=0 keeps arrival 0.0; only an unset arrival (None) takes the
    scheduler's clock; an unset deadline is arrival + the TTFT SLO, a set one is kept."""
    s, ex = make("serial", ttft_slo_base=3.0, ttft_slo_per_token=0.0)
    ex.clock.now = 5.0
    at_zero, unset, due = Req("a", [1] * 10, 2, arrival=0.0), Req("b", [2] * 10, 2), Req("c", [3] * 10, 2, deadline=9.0)
    for r in (at_zero, unset, due):
        s.add(r)
    assert (at_zero.arrival, unset.arrival, due.arrival) == (0.0, 5.0, 5.0)
    assert (at_zero.deadline, unset.deadline, due.deadline) == (3.0, 8.0, 9.0)


def test_failed_rounds_are_dropped_by_the_scheduler():
    """fail_inflight() drops every round in flight, aborts their requests and frees their pages,
    active slots and the rounds' checkpoint slots; requests not in those rounds carry on."""
    s, ex = make("serial", target_step=0.01, max_running=4, checkpoints=16)
    a, b = req("a", prompt(1, 900), new=3), req("b", prompt(2, 300), new=3)
    s.add(a)
    batch = s.schedule()  # a's first chunks, with checkpoint slots
    assert batch.chunks and any(c.checkpoints for c in batch.chunks)
    s.add(b)
    failed = s.fail_inflight()
    assert failed == [a] and a.finish_reason == "abort" and not s.inflight
    run(s, ex, [])
    assert b.finished and b.finish_reason == "length"
    s.check_integrity()
    s.flush_cache()
    st = s.cache.state_pool
    assert s.cache.kv_pool.num_free == s.cache.kv_pool.num_pages
    assert st.num_free_active == st.num_active and st.num_free_checkpoints == st.num_checkpoints


@pytest.mark.parametrize("policy", ["serial", "serial+deadline"])
def test_max_round_tokens_caps_the_serial_rounds(policy):
    """With max_round_tokens, no round of the serial policies holds more tokens (decode rows plus
    prefill chunks) than the cap, however cheap the cost model says they are, except where decode
    rows leave less than one G step: then the first chunk still advances one G step (at a cap of
    G beside 8 decode rows). A cap below G is refused. The same requests finish either way, in
    more rounds."""
    cheap = CostModel(c0=1e-4, c_tok=1e-8, attn_layers=2)  # a fast device: 0.1 s holds ~10M tokens
    rounds, over = {}, {}
    for cap in (None, 640, 96, 64):
        s, ex = make(policy, cost=cheap, max_running=8, target_step=0.1, max_step=0.1, max_round_tokens=cap)
        reqs = [req(f"r{i}", prompt(i, 1000), new=3) for i in range(8)]
        out = run(s, ex, reqs)
        assert all(r.finished for r in reqs)
        rounds[cap] = len(out.rounds)
        if cap is not None:
            g = s.policy.g
            over[cap] = [(t, d) for _, _, t, d in out.rounds if t > cap]
            # over the cap only where decode rows leave less than G, and then by one G step of prefill
            assert all(d > cap - g and t - d == g for t, d in over[cap]), over[cap]
    assert rounds[None] < rounds[640] < rounds[96] <= rounds[64]
    assert not over[640] and not over[96] and over[64]  # the progress rule ran
    with pytest.raises(ValueError, match="max_round_tokens=32 is below the checkpoint grid G=64"):
        make(policy, max_round_tokens=32)
    with pytest.raises(ValueError, match="max_round_tokens must be >= 1"):
        SchedulerConfig(max_round_tokens=0)


@pytest.mark.parametrize("policy", ["tokens", "budget", "serial", "serial+deadline"])
@pytest.mark.parametrize("cap", [None, 1024])
def test_most_tokens_bounds_every_round(policy, cap):
    """policy.most_tokens(), the size of the engine's start-up warm-up forward, is an upper bound
    on every round the policy plans (prompts long and short arriving over time, decode rows
    beside), and a close one: the largest round holds at least half of it (serial+deadline: of
    the bound at target_step, as no prompt here is late enough for its rounds to grow).
    Under a cap that decode rows fill, every decode row plus the first chunk's G step bounds it."""
    s, ex = make(policy, max_running=16, token_budget=512, target_step=0.05, max_step=0.2, max_round_tokens=cap)
    bound = s.policy.most_tokens()
    reqs = [req(f"r{i}", prompt(i, n), new=8, at=0.01 * i) for i, n in enumerate([3000, 200, 5000, 64, 900] * 4)]
    out = run(s, ex, reqs)
    assert all(r.finished for r in reqs)
    largest = max(t for _, _, t, _ in out.rounds)
    assert largest <= bound, (largest, bound)
    at_target = bound if policy != "serial+deadline" else min(int((0.05 - COST.c0) / COST.c_tok), cap or 10**9)
    assert largest >= at_target / 2, (largest, at_target)
    if policy in ("tokens", "budget"):
        assert bound == 512 + 16  # the budget and every decode row
    else:  # the predicted time that c_tok alone would fill, or the cap
        step = 0.05 if policy == "serial" else 0.2
        assert bound == min(int((step - COST.c0) / COST.c_tok), cap or 10**9)
        # a cap below every decode row plus one G step: the progress rule's round is the bound
        tight, _ = make(policy, max_running=16, max_round_tokens=64)
        assert tight.policy.most_tokens() == 16 + tight.policy.g
