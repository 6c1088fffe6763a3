"""The 1M-token TTFT against the context-parallel degree (SIMULATED, H200 profile).

    python -m benchmarks.ttft_1m --cp-sweep 1 2 4 8      # (about 5 min on 2 cores)

For each CP degree P (P H200s, each prefill segment of >= P x 64 tokens split in P slices,
scheduler/cost.py): the long prompt alone in one round (the one-shot prefill, by the cost
model, with its parts: GEMMs, attention, serial steps), and the TTFT study's policies beside
the decode streams over the release sweep, each policy's best point (`ttft_1m.best`: the
lowest TTFT meeting the deadline and the ITL p99 target). The single-device serial floor,
c_serial x ceil(prompt / 64), is what no schedule on one device goes below. Writes
benchmarks/results/ttft_1m_cp.{json,md,png}.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from benchmarks.parallel import run_points
from benchmarks.ttft_1m import OURS, Setting, best, jobs_for, point
from benchmarks.ttft_report import kt
from scheduler import BatchShape, CostModel

POLICIES = (OURS, "tokens+mixed")


def one_shot(cost: CostModel, prompt: int) -> dict:
    """The prompt alone in one round: seconds and their parts."""
    f = cost.features(BatchShape([(0, prompt)]))
    return {"one_shot_s": cost.step_time(BatchShape([(0, prompt)])), "gemm_s": cost.c_tok * f[1],
            "attention_s": cost.c_attn * f[2], "serial_s": cost.c_serial * f[5]}


def sweep(base: Setting, degrees: list[int], releases: tuple[int, ...], workers: int, out: Path) -> str:
    jobs = []
    for p in degrees:
        jobs += jobs_for(replace(base, cp=p), releases, POLICIES, sensitivity=False, cut_study=False)
    jobs = [(f"cp {j[4].cp}", *j[1:]) for j in jobs]
    rows = run_points(point, jobs, workers, "cp points", label=lambda j: f"{j[0]}: {j[1]} R={j[2]}",
                      first=lambda j: -j[4].prompt / j[2])
    single = base.cost()
    summary = []
    for p in degrees:
        cost = replace(base, cp=p).cost()
        mine = [r for r in rows if r["cp"] == p]
        summary.append({"cp": p, **one_shot(cost, base.prompt),
                        "serial_floor_1gpu_s": single.c_serial * single.serial_steps(base.prompt),
                        **{pol: best([r for r in mine if r["policy"] == pol]) for pol in POLICIES}})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setting": base.__dict__, "summary": summary, "rows": rows}, indent=1))
    text = report(base, summary)
    out.with_suffix(".md").write_text(text)
    plot(base, summary, out.with_suffix(".png"))
    return text


def report(base: Setting, summary: list[dict]) -> str:
    cost = base.cost()
    lines = [
        f"# 1M-token TTFT against the context-parallel degree (SIMULATED: profile {base.profile})",
        "",
        f"{kt(base.prompt)}-token prompt; beside it {base.streams} decode streams ({kt(base.stream_prompt)}-token "
        f"prompts) for the policies. CP = P: P H200s, each long prefill segment split in P contiguous slices; "
        f"cp_overhead {cost.cp_overhead} (the widened state pass, scheduler/profiles). Best point per policy: "
        f"the lowest TTFT meeting the deadline ({base.slo_factor} x that degree's one-shot prefill) and ITL p99 "
        f"<= {base.itl_slo * 1e3:.0f} ms.",
        "",
        "| CP | one-shot prefill s | GEMMs s | attention s (busiest rank) | serial s | serial floor, one GPU s | "
        + " | ".join(f"{p}: TTFT s / ITL p99 ms (R)" for p in POLICIES) + " |",
        "|---|---:|---:|---:|---:|---:|" + "---|" * len(POLICIES),
    ]
    for s in summary:
        cells = [f"{s[p]['ttft_s']:.1f} / {s[p]['itl_p99_s'] * 1e3:.0f} ({kt(s[p]['release'])})" for p in POLICIES]
        lines.append(f"| {s['cp']} | {s['one_shot_s']:.1f} | {s['gemm_s']:.1f} | {s['attention_s']:.1f} | "
                     f"{s['serial_s']:.2f} | {s['serial_floor_1gpu_s']:.2f} | " + " | ".join(cells) + " |")
    one = summary[0]
    lines += ["", f"At CP = 1 the one-shot prefill is {one['one_shot_s']:.0f} s, of which the serial chain is "
              f"{one['serial_s']:.1f} s: on this profile the 1M prefill is bound by MLA attention, and the "
              "contiguous split leaves the last rank (2P - 1) / P^2 of the pairs (a load-balanced split would leave "
              "1 / P; not built). Context parallelism is the only way below the serial floor: the serial part drops "
              "to (1 + cp_overhead) / P of it."]
    return "\n".join(lines) + "\n"


def plot(base: Setting, summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [s["cp"] for s in summary]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.plot(cps, [s["one_shot_s"] for s in summary], "k-o", label="prompt alone, one round (cost model)")
    styles = {OURS: ("tab:green", "D", "-"), "tokens+mixed": ("tab:orange", "v", ":")}
    for p in POLICIES:
        color, marker, ls = styles[p]
        ax.plot(cps, [s[p]["ttft_s"] for s in summary], color=color, marker=marker, ls=ls,
                label=f"{p}, best point beside {base.streams} decode streams")
    ax.plot(cps, [s["serial_s"] for s in summary], "b--s", label="serial part of the one-round prefill")
    ax.axhline(summary[0]["serial_floor_1gpu_s"], color="b", lw=1, ls=":", label="serial floor on one GPU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("context-parallel degree (H200s)")
    ax.set_ylabel("TTFT of the long prompt (s, log; lower is better)")
    ax.set_title(f"SIMULATED: {kt(base.prompt)}-token prefill TTFT vs CP degree\n"
                 f"Kimi-Linear-48B profile ({base.profile})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
