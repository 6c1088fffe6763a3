"""The TTFT study measured on this machine, and the simulator's error against it.

    python -m benchmarks.ttft_1m --real        # measured: the built-in model, real forwards
    python -m benchmarks.ttft_1m --validate    # calibrate here, then each point real and simulated

A `--real-prompt`-token prompt (16K) arrives while `--real-streams` (8) requests decode, on the
built-in model on this CPU, under two policies at several release amounts. `--validate` first
fits the cost model here (`hybridserve calibrate`'s procedure), runs every point for real with
that profile and on the `sim` executor with the engine's pool sizes, and reports the
prediction error of TTFT and ITL p50 / p99 per point: (simulated - measured) / measured.
Writes benchmarks/results/ttft_real.{json,md} (and ttft_real_profile.json when validating).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.ttft_1m import RESULTS, Setting, knobs, long_chunks, measure, scheduler_config, simulate_study
from scheduler import CostModel
from state_cache import CacheConfig, KVPool, StatePool, StateRadixCache

POLICIES = ("budget", "serial+deadline")
RELEASES = (1024, 4096, 16384)
METRICS = ("ttft_s", "itl_p50_s", "itl_p99_s")
TARGET = 0.15  # the simulator's error budget per metric


def real_setting(prompt: int, streams: int, profile: str) -> Setting:
    return Setting(prompt=prompt, streams=streams, stream_prompt=512, profile=profile, slo_factor=1.5, itl_slo=0.25)


def engine_for(s: Setting, cost: CostModel, profile: str, **knob):
    from hybridserve import Engine

    config = scheduler_config(s, cost, **knob)
    return Engine(cost_profile=profile, **{k: getattr(config, k) for k in (
        "policy", "max_running", "token_budget", "target_step", "max_step", "mixed_chunk",
        "ttft_slo_base", "ttft_slo_per_token")})


def real_point(s: Setting, cost: CostModel, profile: str, policy: str, release: int, decode_tokens: int,
               seed: int = 0) -> dict:
    """The study's protocol on the engine: streams start decoding, the long prompt arrives,
    step until its first token (wall clock)."""
    from hybridserve import SamplingParams

    knob = knobs(policy, release, cost, s)
    engine = engine_for(s, cost, profile, **knob)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0)
    warm = engine.add_request([rng.randrange(vocab) for _ in range(256)], SamplingParams(max_tokens=4))
    while engine.has_unfinished():  # first forwards pay one-off costs
        engine.step()
    del warm
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(s.stream_prompt)], params) for _ in
            range(s.streams)]
    streams = [engine.requests[r][0] for r in rids]
    while any(r.first_token_at is None for r in streams):
        engine.step()
    lid = engine.add_request([rng.randrange(vocab) for _ in range(s.prompt)], SamplingParams(max_tokens=2))
    long = engine.requests[lid][0]
    chunks: list[tuple[int, int, float]] = []
    host = runner = predicted = 0.0  # seconds outside the executor, in it, and predicted
    t0 = time.perf_counter()
    while long.first_token_at is None:
        t1 = time.perf_counter()
        batch = engine.scheduler.schedule()
        if batch is None:
            continue
        out = engine.executor.run(batch)
        engine.scheduler.process(batch, out)
        host += time.perf_counter() - t1 - out.elapsed
        runner += out.elapsed
        predicted += batch.predicted
        chunks += long_chunks(batch, long, cost, batch.predicted)
    wall = time.perf_counter() - t0
    if any(r.finished for r in streams):
        raise RuntimeError("a stream finished before the long prompt's first token: raise decode_tokens")
    for rid in list(engine.requests):
        engine.abort(rid)
    return {"policy": policy, "release": release, **asdict(s), "knobs": knob, **measure(long, streams, chunks),
            "wall_s": wall, "scheduler_s": host, "executor_s": runner, "predicted_s": predicted,
            "measured": True, "kv_pages": engine.plan.num_pages,
            "checkpoint_slots": engine.plan.num_checkpoints}


def sim_point(s: Setting, cost: CostModel, engine_pages: int, engine_slots: int, policy: str, release: int,
              decode_tokens: int) -> dict:
    """The same point on the sim executor, with the engine's pool sizes."""
    knob = knobs(policy, release, cost, s)
    cache = StateRadixCache(KVPool(engine_pages, s.page), StatePool(s.streams + 8, engine_slots),
                            {"kda": cost.chunk}, CacheConfig())
    long, streams, ex = simulate_study(cache, scheduler_config(s, cost, **knob), cost, s, decode_tokens)
    return {"policy": policy, "release": release, **asdict(s), "knobs": knob, **measure(long, streams, ex.chunks),
            "measured": False}


def errors(real: dict, sim: dict) -> dict:
    """(simulated - measured) / measured per metric, and the worst magnitude."""
    err = {m: (sim[m] - real[m]) / real[m] for m in METRICS}
    return {**{f"err_{m}": e for m, e in err.items()}, "err_max": max(abs(e) for e in err.values())}


def calibrate_here(path: Path, max_context: int, repeats: int = 3) -> CostModel:
    """Fit the built-in model's cost profile on this machine, as `hybridserve calibrate` does,
    over the context range of the runs."""
    from hybridserve import Engine
    from hybridserve.calibrate import calibrate

    e = Engine()
    cost = calibrate(e.model, e.model_config, e.memory, e.cache, repeats=repeats, max_context=max_context)
    cost = replace(cost, meta={**cost.meta, "how": "benchmarks.ttft_1m --validate, calibrated before "
                                                            "the runs"})
    cost.to_json(path)
    return cost


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--real-prompt", type=int, default=16384, help="--real/--validate: long prompt tokens")
    ap.add_argument("--real-streams", type=int, default=8, help="--real/--validate: decode streams")
    ap.add_argument("--real-releases", type=int, nargs="+", default=list(RELEASES),
                    help="--real/--validate: release amounts (tokens)")
    ap.add_argument("--real-policies", nargs="+", default=list(POLICIES), help="--real/--validate: policies")
    ap.add_argument("--decode-tokens", type=int, default=4096, help="--real/--validate: max tokens per stream")
    ap.add_argument("--real-repeats", type=int, default=3,
                    help="--real/--validate: measured runs per point; each metric is their minimum (noise only adds)")


def main(args: argparse.Namespace, validate: bool = False) -> None:
    from tqdm import tqdm

    RESULTS.mkdir(exist_ok=True)
    profile = str(RESULTS / "ttft_real_profile.json") if validate else "builtin_cpu"
    cost = calibrate_here(Path(profile), args.real_prompt) if validate else CostModel.load(profile)
    s = real_setting(args.real_prompt, args.real_streams, profile)
    rows = []
    points = [(p, r) for p in args.real_policies for r in args.real_releases if r <= s.prompt]
    for policy, release in tqdm(points, desc="real points", unit="point"):
        runs = [real_point(s, cost, profile, policy, release, args.decode_tokens, seed=i)
                for i in range(args.real_repeats)]
        real = {**runs[0], **{m: min(r[m] for r in runs) for m in METRICS}, "repeats": len(runs),
                "ttft_spread": max(r["ttft_s"] for r in runs) / min(r["ttft_s"] for r in runs) - 1}
        row = {"real": real}
        if validate:
            sim = sim_point(s, cost, real["kv_pages"], real["checkpoint_slots"], policy, release, args.decode_tokens)
            row.update(sim=sim, **errors(real, sim))
        rows.append(row)
    name = "ttft_real"
    (RESULTS / f"{name}.json").write_text(json.dumps({"validate": validate, "profile": asdict(cost), "rows": rows},
                                                     indent=1))
    text = summary(rows, s, validate)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    print(text)


def summary(rows: list[dict], s: Setting, validate: bool) -> str:
    head = (f"# TTFT study, measured on this machine{' and simulated' if validate else ''}\n\n"
            f"Built-in model, {s.prompt // 1024}K-token prompt beside {s.streams} decode streams "
            f"({s.stream_prompt}-token prompts), profile {Path(s.profile).stem}. Measured = real forwards, wall "
            "clock.\n")
    cols = "| policy | R | TTFT (s) | spread | ITL p50 (ms) | p99 (ms) | rounds |"
    sep = "|---|---|---|---|---|---|---|"
    if validate:
        cols += " sim TTFT | sim p50 | sim p99 | err TTFT | err p50 | err p99 |"
        sep += "---|---|---|---|---|---|"
    lines = [head, cols, sep]
    for row in rows:
        r = row["real"]
        line = (f"| {r['policy']} | {r['release']} | {r['ttft_s']:.2f} | {r['ttft_spread']:.0%} "
                f"| {r['itl_p50_s'] * 1e3:.0f} "
                f"| {r['itl_p99_s'] * 1e3:.0f} | {r['rounds']} |")
        if validate:
            m = row["sim"]
            line += (f" {m['ttft_s']:.2f} | {m['itl_p50_s'] * 1e3:.0f} | {m['itl_p99_s'] * 1e3:.0f} "
                     f"| {row['err_ttft_s']:+.1%} | {row['err_itl_p50_s']:+.1%} | {row['err_itl_p99_s']:+.1%} |")
        lines.append(line)
    if validate:
        worst = max(row["err_max"] for row in rows)
        spread = max(row["real"]["ttft_spread"] for row in rows)
        lines += ["", f"Worst prediction error: {worst:.1%} (target {TARGET:.0%}): "
                      f"{'within' if worst <= TARGET else 'outside'} the target. Measured values are the minimum "
                      f"of {rows[0]['real']['repeats']} runs; the largest TTFT spread between runs of one point "
                      f"(max / min - 1, the machine's noise) was {spread:.0%}."]
    return "\n".join(lines)
