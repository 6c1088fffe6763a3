"""The TTFT study's pieces on small sizes: point bookkeeping, the ITL window, frontiers and the
verdict, aligned vs arbitrary cut accounting, and the validation arithmetic."""
from __future__ import annotations

import pytest

from benchmarks import ttft_1m as study
from benchmarks.ttft_1m import Setting, point
from benchmarks.ttft_real import errors, real_point, real_setting, sim_point
from hybridserve.sim import SimClock, SimExecutor
from scheduler import Batch, BatchShape, Chunk, CostModel, Req, Scheduler, SchedulerConfig
from state_cache import KVPool, StatePool, StateRadixCache

SMALL = Setting(prompt=1 << 14, streams=4, stream_prompt=256)


def test_itl_window_counts_the_gap_open_at_the_end_and_the_one_spanning_the_start():
    assert study.itl_gaps([[0.0, 1.0, 2.0, 5.0]], 1.5, 6.0) == [1.0, 3.0, 1.0]
    assert study.itl_gaps([[0.0]], 1.0, 4.0) == [4.0]  # stalled for the whole prefill: one gap of 4 s
    assert study.itl_gaps([[0.0, 1.0], [0.5]], 2.0, 3.0) == [2.0, 2.5]  # each stream's open gap, from its last token


@pytest.mark.parametrize("policy", ["tokens", "tokens+mixed", "budget", "serial", "serial+deadline"])
def test_point_bookkeeping(policy):
    r = point(("main", policy, 2048, "aligned", SMALL))
    assert r["deadline_met"] == (r["ttft_s"] <= r["deadline_s"])
    assert r["rounds"] >= r["prompt"] / max(r["release_mean"], 1) - 1
    assert 0 < r["long_share_min"] <= r["long_share_mean"] <= 1
    assert r["itl_p50_s"] <= r["itl_p99_s"] <= r["itl_max_s"]
    assert r["wasted_flops"] == 0 and r["checkpointable_cuts"] == 1.0
    if policy == "tokens":  # prefill first: every stream waits out the whole prefill
        assert r["itl_max_s"] >= r["ttft_s"] and r["long_share_min"] == 1.0
        assert r["release_mean"] == 2048
    if policy == "serial":  # each round's predicted time stays under the target
        assert r["itl_max_s"] <= r["knobs"]["target_step"] * (1 + 1e-9)


def test_serial_target_releases_the_amount_at_the_prompt_start():
    cost = SMALL.cost()
    k = study.knobs("serial", 4096, cost, SMALL)
    assert k["target_step"] == pytest.approx(study.round_time(cost, 4096, SMALL))
    assert study.knobs("budget", 4096, cost, SMALL)["token_budget"] == 4096 + SMALL.streams
    r = point(("main", "serial", 4096, "aligned", SMALL))
    assert r["release_mean"] <= 4096  # later rounds release less: attention grows with the prefix


def test_deadline_grows_rounds_to_meet_it():
    tight = Setting(prompt=1 << 14, streams=16, stream_prompt=256, slo_factor=1.2)
    slow = point(("main", "serial", 256, "aligned", tight))
    fast = point(("main", "serial+deadline", 256, "aligned", tight))
    assert not slow["deadline_met"] and fast["deadline_met"]
    assert fast["itl_p99_s"] > slow["itl_p99_s"]  # the price decode pays, bounded by max_step
    assert fast["itl_max_s"] <= fast["knobs"]["max_step"] * (1 + 1e-9)


def test_frontier_dominance_and_best():
    def row(policy, itl, ttft, met=True):
        return {"policy": policy, "itl_p99_s": itl, "ttft_s": ttft, "deadline_met": met, "itl_slo": 0.1}

    a, b, c = row("serial+deadline", 0.05, 100), row("serial+deadline", 0.2, 80), row("budget", 0.3, 90)
    d = row("budget", 0.04, 120)
    assert study.frontier([a, b, c, d]) == [d, a, b]
    assert study.beats(b, c) and not study.beats(a, c) and not study.beats(c, a)
    assert study.undominated([a, b, c, d]) == [d]  # nothing of ours reaches 40 ms
    assert study.best([a, b, c, d]) is a  # lowest TTFT under the 100 ms ITL target
    assert study.best([row("x", 1.0, 5, met=False), row("y", 2.0, 9)])["policy"] == "y"


def test_study_jobs_cover_the_sweeps():
    jobs = study.jobs_for(Setting(), releases=(2048, 262144))
    studies = {j[0] for j in jobs}
    assert studies == {"main", "cuts", "prompt 128K", "prompt 512K", "8 streams", "256 streams"}
    assert {j[3] for j in jobs if j[0] == "cuts"} == {"arbitrary", "arbitrary-replay"}
    assert not [j for j in jobs if j[2] > j[4].prompt]  # no release larger than the prompt


def test_replay_executor_prices_the_recomputed_tokens():
    cost = CostModel.load("kimi_linear_48b_h200")
    req = Req("r", [1] * 1000, 1)
    batch = Batch([Chunk(req, 100, 300)], [], BatchShape([(100, 200)]), 0.0)
    plain, replay = SimExecutor(cost, SimClock()), SimExecutor(cost, SimClock(), replay_grid=64)
    plain.run(batch)
    replay.run(batch)
    assert plain.clock.now == pytest.approx(cost.step_time(BatchShape([(100, 200)])))
    assert replay.clock.now == pytest.approx(cost.step_time(BatchShape([(64, 236)])))
    assert replay.replayed == [(req, 64, 100)] and plain.replayed == []


def test_arbitrary_cuts_end_where_the_budget_ends_and_write_no_off_grid_checkpoint():
    def cuts(aligned: bool):
        cache = StateRadixCache(KVPool(64, 64), StatePool(4, 64), {"kda": 64})
        s = Scheduler(cache, SchedulerConfig(policy="tokens", token_budget=100, aligned_cuts=aligned),
                      CostModel(c0=1e-3), SimClock())
        s.add(Req("r", list(range(1000, 1300)), 1))
        out = []
        while (b := s.schedule()) is not None:
            out += [(c.start, c.end, [p for p, _ in c.checkpoints]) for c in b.chunks]
            s.process(b, SimExecutor(CostModel(c0=1e-3), SimClock()).run(b))
        return out

    assert [(a, b) for a, b, _ in cuts(True)] == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]
    arbitrary = cuts(False)
    assert [(a, b) for a, b, _ in arbitrary] == [(0, 100), (100, 200), (200, 300)]
    for start, end, positions in arbitrary:  # a chunk off the grid can only write its own end
        assert start % 64 == 0 or set(positions) <= {end}


def test_retraction_replay_accounting():
    aligned = [(0, 64, 1.0), (64, 128, 1.0), (128, 150, 1.0)]
    assert study.retraction_replay(aligned, 64) == {"checkpointable_cuts": 1.0, "retraction_replay_tokens": 0.0}
    arbitrary = [(0, 100, 1.0), (100, 200, 1.0), (200, 250, 1.0)]
    # after the first chunk the deepest checkpoint is 64 (36 lost), after the second still 64 (136)
    assert study.retraction_replay(arbitrary, 64) == {"checkpointable_cuts": 0.0, "retraction_replay_tokens": 86.0}


def test_aligned_vs_arbitrary_points():
    aligned, arbitrary, replay = (point(("cuts", "serial", 2048, c, SMALL))
                                  for c in ("aligned", "arbitrary", "arbitrary-replay"))
    assert aligned["wasted_flops"] == arbitrary["wasted_flops"] == 0 < replay["wasted_flops"]
    assert replay["replayed_tokens"] < replay["rounds"] * SMALL.page
    assert replay["ttft_s"] > arbitrary["ttft_s"]  # the same cuts, plus the recomputation
    assert arbitrary["checkpointable_cuts"] < 0.5 < aligned["checkpointable_cuts"]
    assert arbitrary["retraction_replay_tokens"] > aligned["retraction_replay_tokens"] == 0


def test_profile_reconciles_the_published_one_shot_figures():
    """One H200: ~151 s for a one-shot 1M prefill; split over 8 GPUs, ~20 s for Kimi Linear and
    ~58-66 s for full MLA (27 attention layers), the report's figures."""
    cost = CostModel.load("kimi_linear_48b_h200")
    one = BatchShape([(0, 1 << 20)])
    assert cost.step_time(one) == pytest.approx(151, rel=0.01)
    eight = cost.on_gpus(8)
    assert eight.c_serial == cost.c_serial and eight.c_dec_attn == cost.c_dec_attn and eight.c0 == cost.c0
    assert eight.c_attn == cost.c_attn / 8 and eight.c_tok == cost.c_tok / 8
    assert eight.step_time(one) == pytest.approx(20.7, rel=0.01)
    mla = CostModel(**{**cost.__dict__, "attn_layers": 27, "c_serial": 0.0}).on_gpus(8)
    assert 55 < mla.step_time(one) < 70
    with pytest.raises(ValueError, match="gpus"):
        cost.on_gpus(0)


def test_validation_error_arithmetic():
    real = {"ttft_s": 10.0, "itl_p50_s": 0.1, "itl_p99_s": 0.2}
    sim = {"ttft_s": 11.0, "itl_p50_s": 0.09, "itl_p99_s": 0.2}
    e = errors(real, sim)
    assert e["err_ttft_s"] == pytest.approx(0.1) and e["err_itl_p50_s"] == pytest.approx(-0.1)
    assert e["err_itl_p99_s"] == 0 and e["err_max"] == pytest.approx(0.1)


def test_real_and_simulated_points_make_the_same_rounds():
    """A token-budget policy's plan does not depend on time: the engine on real forwards and the
    sim executor with the engine's pool sizes cut the long prompt identically."""
    s = real_setting(prompt=1024, streams=2, profile="builtin_cpu")
    cost = CostModel.load("builtin_cpu")
    real = real_point(s, cost, "builtin_cpu", "budget", 256, decode_tokens=256)
    sim = sim_point(s, cost, real["kv_pages"], real["checkpoint_slots"], "budget", 256, decode_tokens=256)
    assert real["measured"] and not sim["measured"]
    assert real["rounds"] == sim["rounds"] == 4
    assert real["release_mean"] == sim["release_mean"] == 256
    assert real["ttft_s"] > 0 and sim["ttft_s"] > 0
