"""A 1M-token prompt under a steady decode load, on the H200 / Kimi-Linear-48B cost profile."""
import pytest

from hybridserve.sim import SimClock, SimExecutor, simulate
from scheduler import CostModel, Req, Scheduler, SchedulerConfig
from state_cache import KVPool, StatePool, StateRadixCache

H200 = CostModel.load("kimi_linear_48b_h200")
LONG = 1 << 20
STREAMS, STREAM_PROMPT, STREAM_NEW = 64, 4096, 4000
SLO = 180.0  # seconds for the long prompt; one-shot prefill alone is ~151 s on this profile


def run(policy: str, slo: float = SLO, **kw):
    """TTFT of the long prompt and the inter-token gaps of the decode streams."""
    clock = SimClock()
    pages = LONG // 64 + STREAMS * ((STREAM_PROMPT + STREAM_NEW) // 64 + 2)
    cache = StateRadixCache(KVPool(pages, 64), StatePool(STREAMS + 8, 256), {"kda": 64})
    kw = {"target_step": 0.05, **kw}  # a 50 ms ITL target on the H200
    s = Scheduler(cache, SchedulerConfig(policy=policy, max_running=STREAMS + 8, **kw), H200, clock)
    streams = [Req(f"s{i}", [1000 + i] * STREAM_PROMPT, STREAM_NEW, arrival=0.0, deadline=5.0)
               for i in range(STREAMS)]
    long = Req("long", [7] * LONG, 4, arrival=1.0, deadline=1.0 + slo)
    simulate(s, SimExecutor(H200, clock), streams + [long], stop=lambda: long.first_token_at is not None)
    end = clock.now  # a stream still waiting for its next token has an open gap until now
    gaps = [b - a for r in streams for a, b in zip(r.token_times, r.token_times[1:] + [end])]
    return long.first_token_at - long.arrival, gaps, long


def test_deadline_met_under_serial_deadline_missed_under_small_token_chunks():
    """serial+deadline finishes the 1M prompt by its 180 s deadline (decode riding along, gaps
    bounded by max_step); `tokens` with 256-token chunks (decode mixed in) takes ~207 s."""
    ttft_sd, gaps_sd, _ = run("serial+deadline", max_step=0.25)
    ttft_tok, gaps_tok, _ = run("tokens", token_budget=256, mixed_chunk=True)
    print(f"1M TTFT: serial+deadline {ttft_sd:.1f} s, tokens(256, mixed) {ttft_tok:.1f} s; deadline {SLO} s")
    assert ttft_sd <= SLO < ttft_tok
    assert max(gaps_sd) <= 0.25 + 1e-9


def test_infeasible_deadline_runs_at_the_cap_and_decode_is_still_bounded():
    """When no schedule can meet the deadline (100 s < one-shot 151 s), the long prompt runs at
    the step cap: it finishes as fast as the cap allows and no decode gap exceeds the cap."""
    ttft, gaps, _ = run("serial+deadline", slo=100.0, max_step=0.25)
    ttft_serial, _, _ = run("serial")
    assert max(gaps) <= 0.25 + 1e-9
    assert ttft < 0.85 * ttft_serial  # grows its chunks, unlike plain `serial` (~206 s)


@pytest.mark.parametrize("policy,kw,starved", [
    ("tokens", dict(token_budget=2048), True),
    ("serial+deadline", dict(max_step=0.25), False),
])
def test_decode_starvation(policy, kw, starved):
    """`tokens` (prefill first, no mixing) stalls every decode stream for the whole 1M prefill;
    serial+deadline keeps every gap under max_step."""
    _, gaps, _ = run(policy, **kw)
    assert (max(gaps) > 100.0) if starved else (max(gaps) <= 0.25 + 1e-9)
