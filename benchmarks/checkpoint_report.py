"""Tables and plots of the checkpoint-hit benchmark's rows (benchmarks/checkpoint_hit.py)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from benchmarks.replay import GB, POLICIES

STYLE = {"unbounded": dict(ls="--", c="black"), "offline": dict(ls=":", c="black")}


def by_trace(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r["trace"]].append(r)
    return out


def table(rows: list[dict], capacities: list[float]) -> str:
    """Markdown: token (state) hit rate per trace x policy at the given capacities, with the bounds."""
    lines = []
    for name, trace_rows in by_trace(rows).items():
        bound = next((r["token_hit_rate"] for r in trace_rows if r["policy"] == "unbounded"), None)
        head = " | ".join(f"{c / GB:g} GB" for c in capacities)
        lines += [f"\n### {name}" + (f" (unbounded: {bound:.1%})" if bound is not None else ""), "",
                  f"| policy | {head} | TTFT p50 / p95 at {capacities[0] / GB:g} GB (s) |",
                  "|---|" + "---|" * len(capacities) + "---|"]
        for policy in POLICIES:
            if policy == "unbounded":
                continue
            cells = {r["capacity_bytes"]: r for r in trace_rows if r["policy"] == policy}
            if not cells:
                continue
            hits = " | ".join(f"{cells[c]['token_hit_rate']:.1%}" if c in cells else "-" for c in capacities)
            first = cells.get(capacities[0])
            ttft = f"{first['ttft_p50_s']:.2f} / {first['ttft_p95_s']:.2f}" if first else "-"
            lines.append(f"| {policy} | {hits} | {ttft} |")
    return "\n".join(lines)


def report(rows: list[dict], md_path: Path, out_dir: Path) -> None:
    text = ["# Checkpoint-hit benchmark (simulated: Kimi-Linear-48B-A3B on one H200)", "",
            "Token hit rate = prompt tokens the linear layers resumed from a checkpoint / prompt tokens looked up "
            "(a KV hit without a checkpoint is not a hit). Every figure is a simulation."]
    for trace_rows in by_trace(rows).values():
        text.append(table(trace_rows, sorted({r["capacity_bytes"] for r in trace_rows if r["policy"] != "unbounded"})))
    md_path.write_text("\n".join(text) + "\n")
    print("\n".join(text))
    plot_hits(rows, out_dir / "checkpoint_hit_hits.png")
    plot_ttft(rows, out_dir / "checkpoint_hit_ttft.png")


def plot_hits(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = by_trace(rows)
    cols = min(3, len(traces))
    rows_ = (len(traces) + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.6 * rows_), squeeze=False)
    for ax, (name, trace_rows) in zip(axes.flat, traces.items()):
        for policy in POLICIES:
            pts = sorted((r["capacity_bytes"] / GB, r["token_hit_rate"]) for r in trace_rows if r["policy"] == policy)
            if not pts:
                continue
            if policy == "unbounded":
                ax.axhline(pts[0][1], label="unbounded (bound)", **STYLE[policy])
                continue
            xs, ys = zip(*pts)
            bold = dict(lw=2.6, zorder=5) if policy == "ours-unified" else {}
            ax.plot(xs, ys, marker="o", ms=3, label=policy, **STYLE.get(policy, {}), **bold)
        caps = sorted({r["capacity_bytes"] / GB for r in trace_rows if r["policy"] != "unbounded"})
        ax.set_xscale("log")
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
        ax.minorticks_off()
        ax.set_title(name)
        ax.set_xlabel("cache capacity (GB: KV pages + checkpoints)")
        ax.set_ylabel("token hit rate (state hits)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=10, fontsize=8)
    fig.suptitle("Token hit rate vs cache capacity, Kimi-Linear-48B on one H200 (simulated; higher is better)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ttft(rows: list[dict], path: Path, trace: str = "mooncake") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    trace_rows = by_trace(rows).get(trace) or next(iter(by_trace(rows).values()))
    caps = sorted({r["capacity_bytes"] for r in trace_rows if r["policy"] != "unbounded"})
    cap = caps[len(caps) // 2] if caps else 0.0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in trace_rows:
        if r["capacity_bytes"] not in (cap, 0.0):
            continue
        t = np.sort(np.asarray(r["ttft_s"]))
        bold = dict(lw=2.6, zorder=5) if r["policy"] == "ours-unified" else {}
        ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=r["policy"], **STYLE.get(r["policy"], {}), **bold)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"TTFT CDF, {trace_rows[0]['trace']} at {cap / GB:.0f} GB (simulated H200; left is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _share(policy: str) -> float | None:
    """The checkpoint_share of a static-split policy, else None."""
    p = POLICIES[policy]
    return p.state_share if policy.startswith("ours-split") else None


def memory_table(rows: list[dict]) -> str:
    """Markdown: per trace and device capacity, the one budget against every static split (the
    best marked) and with each host tier, beside the unbounded bound."""
    lines = ["| trace | device GB | ours-unified | ours-unified-utility | best static split (share) | "
             "worst static split (share) | " + " | ".join(p for p in POLICIES if "+host" in p) + " | unbounded |",
             "|---|---|---|---|---|---|" + "---|" * sum("+host" in p for p in POLICIES) + "---|"]
    for name, trace_rows in by_trace(rows).items():
        bound = next((r["token_hit_rate"] for r in trace_rows if r["policy"] == "unbounded"), float("nan"))
        for cap in sorted({r["capacity_bytes"] for r in trace_rows if r["policy"] != "unbounded"}):
            at = {r["policy"]: r for r in trace_rows if r["capacity_bytes"] == cap}
            splits = sorted((at[p]["token_hit_rate"], _share(p)) for p in at
                            if _share(p) is not None and not at[p].get("rejected"))
            refused = sorted(f"{_share(p):g}" for p in at if _share(p) is not None and at[p].get("rejected"))
            if "ours-unified" not in at or not splits:
                continue
            host = " | ".join(f"{at[p]['token_hit_rate']:.1%}" if p in at else "-" for p in POLICIES if "+host" in p)
            previous = f"{at['ours-unified-utility']['token_hit_rate']:.1%}" if "ours-unified-utility" in at else "-"
            lines.append(f"| {name} | {cap / GB:g} | {at['ours-unified']['token_hit_rate']:.1%} | {previous} | "
                         f"{splits[-1][0]:.1%} ({splits[-1][1]:g}) | {splits[0][0]:.1%} ({splits[0][1]:g}) | "
                         f"{host} | {bound:.1%} |"
                         + (f" static split at {', '.join(refused)} refuses requests longer than its KV pool" if refused
                            else ""))
    return "\n".join(lines)


def memory_report(rows: list[dict], md_path: Path, out_dir: Path) -> None:
    text = ["# Memory study (simulated: Kimi-Linear-48B-A3B on one H200)", "",
            "Token hit rate (state hits) of the one byte budget against the static split at every checkpoint_share "
            "of the sweep, and with host tiers beside the device capacity. Every figure is a simulation.", "",
            memory_table(rows)]
    for r in rows:
        if "+host" in r["policy"]:
            base = next((b for b in rows if b["trace"] == r["trace"] and b["policy"] == "ours-unified"
                         and b["capacity_bytes"] == r["capacity_bytes"]), None)
            if base:
                text.append(f"- {r['trace']} {r['capacity_bytes'] / GB:g} GB + {r['host_bytes'] / GB:g} GB host: "
                            f"host hits {r['host_hit_rate']:.1%} of prompt tokens, {r['host_loads']} loads, "
                            f"{r['host_recomputes']} recomputed instead; TTFT p50 {r['ttft_p50_s']:.2f} s "
                            f"(device only {base['ttft_p50_s']:.2f} s), p95 {r['ttft_p95_s']:.2f} s "
                            f"({base['ttft_p95_s']:.2f} s)")
    md_path.write_text("\n".join(text) + "\n")
    print("\n".join(text))
    plot_memory(rows, out_dir / "checkpoint_memory.png")


def plot_memory(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    traces = by_trace(rows)
    cols = min(3, len(traces))
    fig, axes = plt.subplots(-(-len(traces) // cols), cols, figsize=(5.2 * cols, 3.6 * -(-len(traces) // cols) + 0.8),
                             squeeze=False)
    names = ["blue", "orange", "green", "red"]
    for ax, (name, trace_rows) in zip(axes.flat, traces.items()):
        caps = sorted({r["capacity_bytes"] for r in trace_rows if r["policy"] != "unbounded"})
        for i, cap in enumerate(caps):
            color = f"C{i}"
            at = [r for r in trace_rows if r["capacity_bytes"] == cap]
            pts = sorted((_share(r["policy"]), r["token_hit_rate"]) for r in at
                         if _share(r["policy"]) is not None and not r.get("rejected"))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=color)
            for r in at:
                if r["policy"] == "ours-unified":
                    ax.axhline(r["token_hit_rate"], color=color, lw=2.4)
                elif r["policy"] == "ours-unified-utility":
                    ax.axhline(r["token_hit_rate"], color=color, ls="-.", lw=1.2)
                elif r["policy"].endswith("+host1000"):
                    ax.axhline(r["token_hit_rate"], color=color, ls=":", lw=2)
        bound = next((r["token_hit_rate"] for r in trace_rows if r["policy"] == "unbounded"), None)
        if bound is not None:
            ax.axhline(bound, color="black", ls="--", lw=1)
        ax.set_title(f"{name}: " + ", ".join(f"{names[i % 4]} = {cap / GB:g} GB" for i, cap in enumerate(caps)),
                     fontsize=9.5)
        ax.set_xlabel("checkpoint_share of the static split")
        ax.set_ylabel("token hit rate (state hits)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(traces):]:
        ax.axis("off")
    styles = [Line2D([], [], color="gray", lw=2.4, label="one budget (gdsf eviction, the default)"),
              Line2D([], [], color="gray", ls="-.", lw=1.2, label="one budget, previous utility eviction"),
              Line2D([], [], color="gray", marker="o", label="static split at each checkpoint_share"),
              Line2D([], [], color="gray", ls=":", lw=2, label="one budget + 1 TB host tier"),
              Line2D([], [], color="black", ls="--", lw=1, label="unbounded (no policy can be above)")]
    fig.legend(handles=styles, loc="lower center", ncol=5, fontsize=8.5, frameon=False)
    fig.suptitle("Device memory shared by KV and checkpoints: one byte budget against every static split, at the "
                 "same device bytes\nKimi-Linear-48B on one H200, simulated; token hit rate, higher is better; "
                 "colour = device capacity", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
