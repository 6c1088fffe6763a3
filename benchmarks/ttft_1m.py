"""1M-token prefill TTFT against decode interference, per scheduling policy (sim executor).

    python -m benchmarks.ttft_1m [--profile kimi_linear_48b_h200] [--slo 180] [--streams 64]

A 2^20-token prompt arrives at t = 1 s while `--streams` requests (4096-token prompts) are
decoding. The same Scheduler and StateRadixCache objects as the engine run on the `sim`
executor, whose clock advances by the cost profile's predicted step times. For each policy:
TTFT of the long prompt, whether it met its deadline (`--slo` seconds after arrival), and
the decode streams' inter-token gaps (p50 / p99 / max) until that first token.
Writes benchmarks/results/ttft_1m.json and .png.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from hybridserve.sim import SimClock, SimExecutor, simulate
from scheduler import CostModel, Req, Scheduler, SchedulerConfig
from state_cache import KVPool, StatePool, StateRadixCache

RESULTS = Path(__file__).parent / "results"
LONG = 1 << 20
POLICIES = [
    ("tokens", dict(token_budget=2048)),
    ("tokens", dict(token_budget=256, mixed_chunk=True)),
    ("budget", dict(token_budget=2048)),
    ("serial", dict(target_step=0.05)),
    ("serial+deadline", dict(target_step=0.05, max_step=0.25)),
]


def run(cost: CostModel, name: str, kw: dict, slo: float, streams: int, prompt: int = 4096) -> dict:
    clock = SimClock()
    pages = LONG // 64 + streams * ((prompt + 8192) // 64 + 2)
    cache = StateRadixCache(KVPool(pages, 64), StatePool(streams + 8, 256), {"kda": cost.chunk})
    s = Scheduler(cache, SchedulerConfig(policy=name, max_running=streams + 8, **kw), cost, clock)
    decoders = [Req(f"s{i}", [1000 + i] * prompt, 8192, arrival=0.0, deadline=5.0) for i in range(streams)]
    long = Req("long", [7] * LONG, 4, arrival=1.0, deadline=1.0 + slo)
    t0 = time.perf_counter()
    sim = simulate(s, SimExecutor(cost, clock), decoders + [long], stop=lambda: long.first_token_at is not None)
    end = clock.now
    gaps = [b - a for r in decoders for a, b in zip(r.token_times, r.token_times[1:] + [end])]
    ttft = long.first_token_at - long.arrival
    label = name + "".join(f" {k}={v}" for k, v in kw.items())
    return {"policy": label, "ttft_s": ttft, "deadline_met": ttft <= slo, "rounds": len(sim.rounds),
            "itl_p50_s": float(np.percentile(gaps, 50)), "itl_p99_s": float(np.percentile(gaps, 99)),
            "itl_max_s": max(gaps), "sim_wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="kimi_linear_48b_h200")
    ap.add_argument("--slo", type=float, default=180.0)
    ap.add_argument("--streams", type=int, default=64)
    args = ap.parse_args()
    cost = CostModel.load(args.profile)
    rows = [run(cost, name, kw, args.slo, args.streams) for name, kw in POLICIES]
    print(f"1M-token prompt, {args.streams} decode streams, profile {args.profile}, deadline {args.slo:.0f} s")
    print(f"{'policy':44s} {'TTFT s':>8s} {'met':>4s} {'ITL p50':>8s} {'p99':>8s} {'max':>9s}")
    for r in rows:
        print(f"{r['policy']:44s} {r['ttft_s']:8.1f} {'yes' if r['deadline_met'] else 'no':>4s} "
              f"{r['itl_p50_s']:8.3f} {r['itl_p99_s']:8.3f} {r['itl_max_s']:9.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ttft_1m.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.scatter(r["itl_p99_s"], r["ttft_s"], s=40)
        ax.annotate(r["policy"], (r["itl_p99_s"], r["ttft_s"]), fontsize=7)
    ax.axhline(args.slo, ls="--", c="gray")
    ax.set_xscale("log")
    ax.set_xlabel("decode ITL p99 (s, log)")
    ax.set_ylabel("TTFT of the 1M-token prompt (s)")
    fig.tight_layout()
    fig.savefig(RESULTS / "ttft_1m.png", dpi=120)


if __name__ == "__main__":
    main()
