"""Checkpoint-hit benchmark: how much prefill a state cache saves, per cache policy, per trace,
per capacity (simulated at Kimi-Linear-48B / H200 scale; see docs/checkpoint_hit.md).

    python -m benchmarks.checkpoint_hit                 # default sweep, < 10 min on 2 cores
    python -m benchmarks.checkpoint_hit --full          # the whole Mooncake hour as well
    python -m benchmarks.checkpoint_hit --trace my.jsonl --capacities 20 80 --policies ours-unified vllm-align
    python -m benchmarks.checkpoint_hit --real          # the engine's own counters against the replay

Each point replays a trace through the engine's Scheduler and StateRadixCache on the `sim`
executor (the clock advances by the H200 cost profile's step times) under one policy's
configuration at one capacity (bytes of KV pages plus checkpoints). Writes
benchmarks/results/checkpoint_hit.{json,md} and checkpoint_hit_{hits,ttft}.png. Every figure
is a simulation unless it says measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from functools import lru_cache
from pathlib import Path

from benchmarks.parallel import run_points
from benchmarks.replay import GB, POLICIES, replay
from benchmarks.traces import MOONCAKE, TraceRequest, load
from benchmarks.traces.generate import GENERATORS

RESULTS = Path(__file__).parent / "results"
TRACES = ["mooncake", *GENERATORS]
CAPACITIES = {"mooncake": [10, 40, 160, 640]}  # GB; the larger ones are more than one H200 holds
SMALL_CAPACITIES = [2.5, 10, 40]  # the generated traces are smaller: they fit in 40 GB
DEFAULT_MOONCAKE = 2000  # requests of the Mooncake hour in the default run (the first ~9 minutes)
REFERENCES = ("unbounded", "offline")
SWEPT = [p for p in POLICIES if p.startswith("ours-split-") or "+host" in p or p == "ours-unified-utility"]
DEFAULT = [p for p in POLICIES if p not in SWEPT]
MEMORY = ["ours-unified", "ours-split", *SWEPT, "unbounded"]


@lru_cache(maxsize=None)
def trace(name: str, mooncake_requests: int | None) -> tuple[TraceRequest, ...]:
    if name == "mooncake":
        return tuple(load(MOONCAKE, limit=mooncake_requests))
    if name in GENERATORS:
        from benchmarks.traces import Tokens, parse

        tokens = Tokens()
        return tuple(parse(line, tokens, i) for i, line in enumerate(sorted(GENERATORS[name](),
                                                                            key=lambda d: d["timestamp"])))
    return tuple(load(name))


def point(args: tuple[str, str, float, int | None, float | None]) -> dict:
    name, policy, capacity, mooncake_requests, recency = args
    replayed = POLICIES[policy]
    if recency is not None and policy.startswith("ours"):
        replayed = dataclasses.replace(replayed, cache=dataclasses.replace(replayed.cache,
                                                                           eviction_recency_weight=recency))
    t0 = time.perf_counter()
    row = replay(trace(name, mooncake_requests), replayed, capacity)
    return {"trace": Path(name).stem, **row, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", default=TRACES, help=f"trace names ({', '.join(TRACES)})")
    ap.add_argument("--trace", action="append", default=[], help="also replay this JSONL trace file")
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES),
                    help="default: one of each engine's policies; --memory: the memory study's")
    ap.add_argument("--memory", action="store_true",
                    help="the memory study: one budget against the static split at every checkpoint_share of the "
                         "sweep, and with the host tiers (writes checkpoint_memory.*)")
    ap.add_argument("--capacities", nargs="+", type=float,
                    help=f"cache GB (1e9 bytes) for every trace (default: {CAPACITIES['mooncake']} for mooncake, "
                         f"{SMALL_CAPACITIES} for the others)")
    ap.add_argument("--mooncake-requests", type=int, default=DEFAULT_MOONCAKE,
                    help="first N requests of the Mooncake hour (--full: all 12,031)")
    ap.add_argument("--full", action="store_true", help="replay the whole Mooncake hour")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--json", type=Path, default=RESULTS / "checkpoint_hit.json",
                    help="where to write the rows (the .md summary and the PNGs go beside it)")
    ap.add_argument("--recency-weight", type=float,
                    help="eviction_recency_weight of the ours-* policies (used by those with utility eviction: "
                         "ours-unified-utility; default: CacheConfig's)")
    ap.add_argument("--real", action="store_true", help="check the engine's counters against the replay instead")
    args = ap.parse_args(argv)
    if args.real:
        from benchmarks.checkpoint_real import main as real

        real()
        return
    n = None if args.full else args.mooncake_requests
    args.policies = args.policies or (MEMORY if args.memory else DEFAULT)
    if args.memory and args.json == RESULTS / "checkpoint_hit.json":
        args.json = RESULTS / "checkpoint_memory.json"
    names = [t for t in args.traces] + args.trace
    def capacities(t: str) -> list[float]:
        return args.capacities or CAPACITIES.get(t, SMALL_CAPACITIES)

    jobs = [(t, p, c * GB, n, args.recency_weight) for t in names for p in args.policies
            for c in ([0.0] if p == "unbounded" else capacities(t))]
    rows = run(jobs, args.jobs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    from benchmarks.checkpoint_report import memory_report, report

    (memory_report if args.memory else report)(rows, args.json.with_suffix(".md"), args.json.parent)


def run(jobs: list, workers: int) -> list[dict]:
    return run_points(point, jobs, workers, "replays", label=lambda j: f"{Path(j[0]).stem} {j[1]} {j[2] / GB:.0f} GB",
                      first=lambda j: (j[0] != "mooncake", j[1] != "offline"))  # slow first


if __name__ == "__main__":
    main()
