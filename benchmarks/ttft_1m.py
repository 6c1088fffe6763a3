"""The 1M-token prefill TTFT study: the long prompt's TTFT against the decode streams' ITL as
the per-round release amount grows, per scheduling policy (simulated, H200 profile).

    python -m benchmarks.ttft_1m                 # the sweep, sensitivity and cuts (< 10 min, 2 cores)
    python -m benchmarks.ttft_1m --gpus 8        # the attention and GEMM terms split over 8 GPUs
    python -m benchmarks.ttft_1m --cp-sweep 1 2 4 8   # TTFT against the context-parallel degree
    python -m benchmarks.ttft_1m --real          # the same study, measured on the built-in model here
    python -m benchmarks.ttft_1m --validate      # calibrate, run real and simulated, prediction error

One long prompt (`--prompt`, 2^20 tokens) arrives while `--streams` requests decode. The same
Scheduler and StateRadixCache objects as the engine run on the `sim` executor (the clock
advances by the profile's predicted step times). Each point is one policy at one release
amount R: `tokens` / `tokens+mixed` get a token budget of R, `budget` R plus one token per
stream, `serial` / `serial+deadline` the target step time of a round that releases R tokens
at the prompt's start beside the decode rows. Per point: the long prompt's TTFT and whether
it met its deadline, the streams' inter-token gaps (p50 / p99 / max) while it ran, its share
of each round's time, rounds, and (cut study) the FLOPs replayed and the tokens a retraction
would recompute. Writes benchmarks/results/ttft_1m.{json,md} and ttft_1m_*.png.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.parallel import run_points
from hybridserve.sim import SimClock, SimExecutor, simulate
from scheduler import Batch, BatchShape, CostModel, Req, Scheduler, SchedulerConfig, StepOutput
from state_cache import CacheConfig, KVPool, PrefillFlops, StatePool, StateRadixCache

RESULTS = Path(__file__).parent / "results"
# release amounts: 2K, 3K, 4K, 6K, .. 256K (x1.5 / x1.33 steps, so no policy's curve is sampled too coarsely)
RELEASES = tuple(sorted(m << k for k in range(10, 19) for m in (1, 3) if 2048 <= m << k <= 1 << 18))
CUTS = ("aligned", "arbitrary", "arbitrary-replay")
# prefill FLOPs of Kimi-Linear-48B: 6 GFLOP per token + 7 MLA layers x 20.5 kFLOP per (query, key) pair
KIMI_FLOPS = PrefillFlops(6e9, 7 * 2 * 32 * (192 + 128) / 2)


@dataclass(frozen=True)
class Setting:
    """One workload: the long prompt beside decode streams, on a profile."""

    prompt: int = 1 << 20
    streams: int = 64
    stream_prompt: int = 4096
    profile: str = "kimi_linear_48b_h200"
    gpus: int = 1
    cp: int = 1  # context-parallel degree (prefill segments split across this many GPUs)
    page: int = 64
    slo_factor: float = 1.2  # deadline = slo_factor x the predicted one-shot prefill
    itl_slo: float = 0.1  # the decode ITL p99 target drawn on the plots (seconds)

    def cost(self) -> CostModel:
        return CostModel.load(self.profile).on_gpus(self.gpus).context_parallel(self.cp)

    def deadline(self, cost: CostModel) -> float:
        """Seconds after arrival the long prompt's first token is due."""
        return self.slo_factor * cost.step_time(BatchShape([(0, self.prompt)]))


def _serial(name: str):
    def knobs(release: int, cost: CostModel, s: Setting) -> dict:
        target = round_time(cost, release, s)
        return dict(policy=name, target_step=target, max_step=max(0.5, target))
    return knobs


# the study's policies: SchedulerConfig fields that release about R prompt tokens per round
KNOBS = {
    "tokens": lambda release, cost, s: dict(policy="tokens", token_budget=release),
    "tokens+mixed": lambda release, cost, s: dict(policy="tokens", token_budget=release, mixed_chunk=True),
    "budget": lambda release, cost, s: dict(policy="budget", token_budget=release + s.streams),
    "serial": _serial("serial"),
    "serial+deadline": _serial("serial+deadline"),
}
POLICIES = tuple(KNOBS)
OURS = "serial+deadline"  # the policy whose frontier the summary checks against the others'
CUT_POLICIES = ("serial", OURS)  # time-filled chunks: their cuts land off the grid when allowed


def knobs(policy: str, release: int, cost: CostModel, s: Setting) -> dict:
    """SchedulerConfig fields for `policy` of the study releasing about `release` tokens."""
    return KNOBS[policy](release, cost, s)


def round_time(cost: CostModel, release: int, s: Setting) -> float:
    """Predicted seconds of a round that releases `release` tokens at the prompt's start beside
    every stream's decode row (the serial policies' target for release amount R)."""
    return cost.step_time(BatchShape([(0, release)], [s.stream_prompt] * s.streams))


class Recorder(SimExecutor):
    """The sim executor, noting the long prompt's chunk and its share of each round's time."""

    def __init__(self, cost: CostModel, clock: SimClock, long: Req, replay_grid: int | None = None):
        super().__init__(cost, clock, replay_grid=replay_grid)
        self.long = long
        self.chunks: list[tuple[int, int, float]] = []  # (start, end, share of the round's time)

    def run(self, batch: Batch) -> StepOutput:
        out = super().run(batch)
        self.chunks += long_chunks(batch, self.long, self.cost, out.elapsed)
        return out


def long_chunks(batch: Batch, long: Req, cost: CostModel, seconds: float) -> list[tuple[int, int, float]]:
    """(start, end, share of the round's `seconds`) of long's chunks in batch: the share is
    what the round would have cost less without them, by the cost model."""
    mine = [c for c in batch.chunks if c.req is long]
    if not mine or seconds <= 0:
        return []
    rest = BatchShape([(c.start, c.end - c.start) for c in batch.chunks if c.req is not long], batch.shape.decode)
    share = 1 - cost.step_time(rest) / seconds
    return [(c.start, c.end, share) for c in mine]


Job = tuple[str, str, int, str, Setting]  # (study, policy, release, cuts, setting)


def point(job: Job) -> dict:
    """One policy at one release amount with one kind of cuts: the long prompt's TTFT and the
    decode streams' gaps while it ran."""
    study, policy, release, cuts, s = job
    t0 = time.perf_counter()
    cost = s.cost()
    knob = knobs(policy, release, cost, s)
    config = scheduler_config(s, cost, aligned_cuts=cuts == "aligned", **knob)
    decode_tokens = 1 << 16
    pages = s.prompt // s.page + 1 + s.streams * ((s.stream_prompt + decode_tokens) // s.page + 2)
    cache = StateRadixCache(KVPool(pages, s.page), StatePool(s.streams + 8, 512), {"kda": cost.chunk},
                            CacheConfig(), flops=KIMI_FLOPS)
    long, streams, ex = simulate_study(cache, config, cost, s, decode_tokens,
                                       replay_grid=s.page if cuts == "arbitrary-replay" else None)
    replayed = [(a, b) for r, a, b in ex.replayed if r is long]
    wasted = sum(KIMI_FLOPS(b) - KIMI_FLOPS(a) for a, b in replayed)
    return {"study": study, "policy": policy, "release": release, "cuts": cuts, **asdict(s), "knobs": knob,
            **measure(long, streams, ex.chunks), "replayed_tokens": sum(b - a for a, b in replayed),
            "wasted_flops": wasted, "wasted_share": wasted / KIMI_FLOPS(s.prompt),
            **retraction_replay(ex.chunks, cache.granularity), "sim_wall_s": time.perf_counter() - t0}


def scheduler_config(s: Setting, cost: CostModel, **knob) -> SchedulerConfig:
    """The study's SchedulerConfig: room for every stream, every request's TTFT deadline the
    long prompt's (the streams are decoding by the time it matters)."""
    return SchedulerConfig(max_running=s.streams + 8, ttft_slo_base=s.deadline(cost), ttft_slo_per_token=0.0,
                           **knob)


def simulate_study(cache: StateRadixCache, config: SchedulerConfig, cost: CostModel, s: Setting,
                   decode_tokens: int, replay_grid: int | None = None) -> tuple[Req, list[Req], "Recorder"]:
    """Streams prefill and start decoding; then the long prompt arrives; run to its first token."""
    clock = SimClock()
    sched = Scheduler(cache, config, cost, clock)
    streams = [Req(f"s{i}", [1000 + i] * s.stream_prompt, decode_tokens) for i in range(s.streams)]
    long = Req("long", [7] * s.prompt, 4)
    ex = Recorder(cost, clock, long, replay_grid=replay_grid)
    simulate(sched, ex, streams, stop=lambda: all(r.first_token_at is not None for r in streams))
    simulate(sched, ex, [long], stop=lambda: long.first_token_at is not None)
    if any(r.finished for r in streams):
        raise RuntimeError("a stream finished before the long prompt's first token: give it more tokens")
    return long, streams, ex


def measure(long: Req, streams: list[Req], chunks: list[tuple[int, int, float]]) -> dict:
    """TTFT, deadline and the streams' gaps while the long prompt ran; chunks: (start, end,
    share of the round's time) of the long prompt's chunks."""
    ttft = long.first_token_at - long.arrival
    slo = long.deadline - long.arrival
    gaps = itl_gaps([r.token_times for r in streams], long.arrival, long.first_token_at)
    return {"ttft_s": ttft, "deadline_s": slo, "deadline_met": ttft <= slo, **percentiles(gaps),
            "rounds": len(chunks), "release_mean": float(np.mean([e - b for b, e, _ in chunks])),
            "long_share_mean": float(np.mean([sh for *_, sh in chunks])),
            "long_share_min": float(min(sh for *_, sh in chunks))}


def retraction_replay(chunks: list[tuple[int, int, float]], g: int) -> dict:
    """What cutting cost the cache: the share of middle-chunk ends that could be checkpointed
    (a chunk starting on the grid writes its G-positions, one starting off it only its own end
    if that is on the grid), and the tokens a retraction after each middle chunk would have to
    recompute from the deepest checkpoint written so far (mean over chunks)."""
    deepest, ok, lost = 0, 0, []
    middle = chunks[:-1]
    for start, end, _ in middle:
        reach = end // g * g if start % g == 0 else (end if end % g == 0 else 0)
        ok += reach == end
        deepest = max(deepest, reach)
        lost.append(end - deepest)
    return {"checkpointable_cuts": ok / len(middle) if middle else 1.0,
            "retraction_replay_tokens": float(np.mean(lost)) if lost else 0.0}


def itl_gaps(token_times: list[list[float]], start: float, end: float) -> list[float]:
    """Inter-token gaps of each stream that end after `start`, up to `end`; the gap still open
    at `end` counts (a stream stalled until then waited at least that long)."""
    gaps = []
    for times in token_times:
        before = [t for t in times if t <= start][-1:]
        inside = [t for t in times if start < t <= end]
        marks = before + inside + [end]
        gaps += [b - a for a, b in zip(marks, marks[1:]) if b > a]
    return gaps


def percentiles(gaps: list[float]) -> dict:
    return {"itl_p50_s": float(np.percentile(gaps, 50)), "itl_p99_s": float(np.percentile(gaps, 99)),
            "itl_max_s": float(max(gaps))}


# -- reading the points -----------------------------------------------------------------------

def frontier(rows: list[dict]) -> list[dict]:
    """The points no other point of `rows` beats on both ITL p99 and TTFT, by ITL p99."""
    pts = sorted(rows, key=lambda r: (r["itl_p99_s"], r["ttft_s"]))
    out: list[dict] = []
    for r in pts:
        if not out or r["ttft_s"] < out[-1]["ttft_s"]:
            out.append(r)
    return out


def beats(a: dict, b: dict, tol: float = 0.01) -> bool:
    """a is at least as good as b on both axes (within tol, relative)."""
    return a["itl_p99_s"] <= b["itl_p99_s"] * (1 + tol) and a["ttft_s"] <= b["ttft_s"] * (1 + tol)


def undominated(rows: list[dict], ours: str = OURS, tol: float = 0.01) -> list[dict]:
    """Points of the other policies that meet their deadline and that no point of `ours`
    matches on both axes."""
    mine = [r for r in rows if r["policy"] == ours]
    return [r for r in rows if r["policy"] != ours and r["deadline_met"] and not any(beats(m, r, tol) for m in mine)]


def best(rows: list[dict]) -> dict:
    """The lowest TTFT among points that meet the deadline and the ITL p99 target; if none,
    the lowest ITL p99 among those meeting the deadline; if none, the lowest TTFT."""
    ok = [r for r in rows if r["deadline_met"] and r["itl_p99_s"] <= r["itl_slo"]]
    if ok:
        return min(ok, key=lambda r: (r["ttft_s"], r["policy"] != OURS))
    met = [r for r in rows if r["deadline_met"]]
    if met:
        return min(met, key=lambda r: (r["itl_p99_s"], r["policy"] != OURS))
    return min(rows, key=lambda r: (r["ttft_s"], r["policy"] != OURS))


# -- the run ----------------------------------------------------------------------------------

def jobs_for(base: Setting, releases=RELEASES, policies=POLICIES, sensitivity: bool = True,
             cut_study: bool = True) -> list[Job]:
    """The main sweep (aligned cuts); the cut study (serial and serial+deadline with arbitrary
    and arbitrary-replay cuts); the sensitivity sweeps (1/8 and 1/2 of the prompt; 8 and 256
    streams)."""
    def sweep(study: str, s: Setting, pols, cuts="aligned") -> list[Job]:
        return [(study, p, r, cuts, s) for p in pols for r in releases if r <= s.prompt]

    jobs = sweep("main", base, policies)
    if cut_study:
        for c in CUTS[1:]:
            jobs += sweep("cuts", base, [p for p in CUT_POLICIES if p in policies], c)
    if sensitivity:
        for s in (replace(base, prompt=base.prompt // 8), replace(base, prompt=base.prompt // 2)):
            jobs += sweep(f"prompt {s.prompt // 1024}K", s, policies)
        for s in (replace(base, streams=8), replace(base, streams=256)):
            jobs += sweep(f"{s.streams} streams", s, policies)
    return jobs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=Setting.profile, help="cost profile (name or JSON path)")
    ap.add_argument("--gpus", type=int, default=1, help="split the attention and GEMM terms over N GPUs")
    ap.add_argument("--cp", type=int, default=1,
                    help="split each long prefill segment across N GPUs (context parallel)")
    ap.add_argument("--cp-sweep", type=int, nargs="+", metavar="N",
                    help="TTFT against the context-parallel degree (writes ttft_1m_cp.*; benchmarks/ttft_cp.py)")
    ap.add_argument("--prompt", type=int, default=Setting.prompt, help="long prompt tokens")
    ap.add_argument("--streams", type=int, default=Setting.streams, help="decode streams")
    ap.add_argument("--slo-factor", type=float, default=Setting.slo_factor,
                    help="the long prompt's deadline, as a multiple of its predicted one-shot prefill")
    ap.add_argument("--itl-slo", type=float, default=Setting.itl_slo, help="decode ITL p99 target (s)")
    ap.add_argument("--releases", type=int, nargs="+", default=list(RELEASES), help="release amounts (tokens)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the 128K/512K and 8/256-stream sweeps")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--json", type=Path, default=RESULTS / "ttft_1m.json",
                    help="where to write the points (the .md summary and PNGs go beside it)")
    ap.add_argument("--real", action="store_true", help="measure the study on the built-in model on this machine")
    ap.add_argument("--validate", action="store_true",
                    help="calibrate here, run small workloads real and simulated, report the prediction error")
    from benchmarks import ttft_real

    ttft_real.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.real or args.validate:
        ttft_real.main(args, validate=args.validate)
        return
    base = Setting(prompt=args.prompt, streams=args.streams, profile=args.profile, gpus=args.gpus, cp=args.cp,
                   slo_factor=args.slo_factor, itl_slo=args.itl_slo)
    if args.cp_sweep:
        from benchmarks.ttft_cp import sweep

        print(sweep(base, args.cp_sweep, tuple(args.releases), args.jobs, args.json.with_name("ttft_1m_cp.json")))
        return
    jobs = jobs_for(base, tuple(args.releases), tuple(args.policies), sensitivity=not args.no_sensitivity)
    rows = run_points(point, jobs, args.jobs, "ttft points",
                      label=lambda j: f"{j[0]}: {j[1]} R={j[2]} {j[3]}",
                      first=lambda j: -j[4].prompt * j[4].streams / j[2])  # many rounds first
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    from benchmarks.ttft_report import report

    print(report(rows, args.json.with_suffix(".md"), args.json.parent))


if __name__ == "__main__":
    main()
