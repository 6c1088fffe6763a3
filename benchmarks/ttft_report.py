"""Markdown summary and plots of the TTFT study's points (benchmarks.ttft_1m)."""
from __future__ import annotations

from pathlib import Path

from benchmarks.ttft_1m import OURS, POLICIES, best, frontier, undominated

STYLE = {"tokens": ("tab:red", "o"), "tokens+mixed": ("tab:orange", "v"), "budget": ("tab:purple", "s"),
         "serial": ("tab:blue", "^"), "serial+deadline": ("tab:green", "D")}
# drawing order and lines: ours thick underneath, so a policy that coincides with another stays visible
DRAW = [("serial+deadline", "-", 4.0), ("budget", "-", 2.0), ("tokens", "-", 1.5), ("serial", "--", 1.5),
        ("tokens+mixed", ":", 2.0)]


def kt(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def describe(r: dict) -> str:
    return f"{r['policy']} at R = {kt(r['release'])}"


def setting_line(r: dict) -> str:
    gpus = f", {r['gpus']} GPUs" if r["gpus"] > 1 else ", one GPU"
    gpus += f", context parallel x {r['cp']}" if r.get("cp", 1) > 1 else ""
    return (f"{kt(r['prompt'])}-token prompt beside {r['streams']} decode streams ({kt(r['stream_prompt'])}-token "
            f"prompts), profile {r['profile']}{gpus}, page {r['page']}; deadline {r['deadline_s']:.1f} s "
            f"({r['slo_factor']} x the one-shot prefill), ITL p99 target {r['itl_slo'] * 1000:.0f} ms")


def table(rows: list[dict]) -> list[str]:
    out = ["| policy | R | TTFT (s) | met | ITL p50 (ms) | p99 (ms) | max (ms) | long's share | rounds | mean chunk |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['policy']} | {kt(r['release'])} | {r['ttft_s']:.1f} | {'yes' if r['deadline_met'] else 'no'} "
                   f"| {r['itl_p50_s'] * 1e3:.0f} | {r['itl_p99_s'] * 1e3:.0f} | {r['itl_max_s'] * 1e3:.0f} "
                   f"| {r['long_share_mean']:.0%} | {r['rounds']} | {r['release_mean']:.0f} |")
    return out


def verdict(rows: list[dict]) -> list[str]:
    """Whether OURS lies on or beyond every other policy's frontier (among the points that
    meet the deadline: OURS never trades the deadline away, so it offers none that miss it)."""
    if not any(r["policy"] == OURS for r in rows):
        return []
    left = undominated(rows)
    missed = [r for r in rows if r["policy"] != OURS and not r["deadline_met"]]
    out = [f"Every point of the other policies that meets the deadline is matched or beaten by a {OURS} point on "
           f"both axes (ITL p99 and TTFT, 1% tolerance): {OURS} lies on or beyond every such frontier."] if not left \
        else [f"{len(left)} point(s) of other policies meet the deadline and are not matched by any {OURS} point "
              "(1% tolerance):", *(f"- {describe(r)}: TTFT {r['ttft_s']:.1f} s, ITL p99 "
                                  f"{r['itl_p99_s'] * 1e3:.0f} ms" for r in left)]
    if missed:
        out += ["", f"Points that miss the deadline ({OURS} grows its rounds instead, so it has no point there): "
                + ", ".join(f"{describe(r)} ({r['ttft_s']:.1f} s, {r['itl_p99_s'] * 1e3:.0f} ms)" for r in missed)
                + "."]
    return out


def cut_summary(rows: list[dict]) -> list[str]:
    out = []
    by = {(r["policy"], r["release"], r["cuts"]): r for r in rows}
    for (p, rel, cuts), r in sorted(by.items()):
        if cuts == "aligned" or (p, rel, "aligned") not in by:
            continue
        a = by[(p, rel, "aligned")]
        out.append(f"| {p} | {kt(rel)} | {cuts} | {r['ttft_s'] - a['ttft_s']:+.2f} | "
                   f"{(r['ttft_s'] / a['ttft_s'] - 1):+.2%} | {r['itl_p99_s'] * 1e3 - a['itl_p99_s'] * 1e3:+.1f} | "
                   f"{r['wasted_flops'] / 1e15:.2f} | {r['wasted_share']:.2%} | "
                   f"{r['checkpointable_cuts']:.0%} | {r['retraction_replay_tokens']:,.0f} |")
    if not out:
        return []
    return ["| policy | R | cuts | TTFT vs aligned (s) | (%) | ITL p99 vs aligned (ms) | replayed PFLOP | "
            "of the prompt's FLOPs | checkpointable cuts | a retraction recomputes (tokens, mean) |",
            "|---|---|---|---|---|---|---|---|---|---|", *out]


def report(rows: list[dict], md: Path, out_dir: Path) -> str:
    """Write the Markdown summary (returned) and the plots."""
    studies = list(dict.fromkeys(r["study"] for r in rows))
    main = [r for r in rows if r["study"] == "main"]
    lines = ["# 1M-token prefill TTFT study (simulated)", "",
             "Every number here is a simulation: the engine's Scheduler and StateRadixCache on the `sim` "
             "executor, whose clock advances by the cost profile's predicted step times. "
             "Regenerate with `python -m benchmarks.ttft_1m`.", ""]
    for study in (s for s in studies if s != "cuts"):
        part = [r for r in rows if r["study"] == study]
        b = best(part)
        lines += [f"## {study}", "", setting_line(part[0]), "",
                  f"Best trade-off point: **{describe(b)}**: TTFT {b['ttft_s']:.1f} s "
                  f"({'meets' if b['deadline_met'] else 'misses'} the {b['deadline_s']:.1f} s deadline), decode ITL "
                  f"p99 {b['itl_p99_s'] * 1e3:.0f} ms (target {b['itl_slo'] * 1e3:.0f} ms).", "",
                  *verdict(part), "", *table(part), ""]
    cuts = [r for r in rows if r["study"] == "cuts"]
    if cuts:
        policies = {r["policy"] for r in cuts}
        aligned = [r for r in main if r["policy"] in policies]
        lines += ["## Aligned vs arbitrary cuts", "", setting_line(cuts[0]), "",
                  "`arbitrary`: middle chunks end where the budget ends; the live state carries over in the "
                  "request's own slot, but a kernel writes states only at multiples of G from a segment's start, "
                  "so no checkpoint lands after the first off-grid cut. `arbitrary-replay`: the same cuts in an "
                  "engine that keeps a request's state only at grid positions, so every chunk first recomputes "
                  "from the grid position below its start.", "",
                  *cut_summary(aligned + cuts), ""]
    md.write_text("\n".join(lines) + "\n")
    plots(rows, out_dir)
    return "\n".join(lines)


def plots(rows: list[dict], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    main = [r for r in rows if r["study"] == "main"]
    if main:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        sweep_axes(axes, main)
        fig.suptitle("Simulated: " + setting_line(main[0]), fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "ttft_1m_sweep.png", dpi=110)
        plt.close(fig)
    others = [s for s in dict.fromkeys(r["study"] for r in rows) if s not in ("main", "cuts")]
    if others:
        fig, axes = plt.subplots(1, len(others), figsize=(4.6 * len(others), 4.4), squeeze=False)
        for ax, study in zip(axes[0], others):
            part = [r for r in rows if r["study"] == study]
            frontier_axis(ax, part)
            ax.set_title(f"{kt(part[0]['prompt'])} prompt, {part[0]['streams']} streams", fontsize=9)
        fig.suptitle("Simulated sensitivity: TTFT-ITL frontier per policy (lower left is better)", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "ttft_1m_sensitivity.png", dpi=110)
        plt.close(fig)
    cuts = [r for r in rows if r["study"] == "cuts"]
    if cuts:
        cut_plot(main, cuts, out_dir / "ttft_1m_cuts.png", plt)


def sweep_axes(axes, rows: list[dict]) -> None:
    for p, ls, lw in DRAW:
        part = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["release"])
        if not part:
            continue
        c, m = STYLE[p]
        xs = [r["release"] for r in part]
        kw = dict(marker=m, c=c, ls=ls, lw=lw, ms=3 + lw, label=p)
        axes[0].plot(xs, [r["ttft_s"] for r in part], **kw)
        axes[1].plot(xs, [r["itl_p99_s"] for r in part], **kw)
    r0 = rows[0]
    axes[0].axhline(r0["deadline_s"], ls="--", c="gray", label="deadline")
    axes[1].axhline(r0["itl_slo"], ls=":", c="gray", label="ITL p99 target")
    for ax, ylabel in ((axes[0], "TTFT of the long prompt (s)"), (axes[1], "decode ITL p99 while it runs (s, log)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("release amount R (prompt tokens per round; serial: at the prompt's start)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].set_title("TTFT vs release amount (lower is better)", fontsize=9)
    axes[1].set_title("decode ITL p99 vs release amount (lower is better)", fontsize=9)
    axes[0].legend(fontsize=7)
    frontier_axis(axes[2], rows)
    axes[2].set_title("TTFT-ITL frontier per policy (lower left is better)", fontsize=9)


def frontier_axis(ax, rows: list[dict]) -> None:
    for p, ls, lw in DRAW:
        part = [r for r in rows if r["policy"] == p]
        if not part:
            continue
        c, m = STYLE[p]
        ax.scatter([r["itl_p99_s"] for r in part], [r["ttft_s"] for r in part], c=c, marker=m, s=6 * lw, alpha=0.6)
        f = frontier(part)
        ax.plot([r["itl_p99_s"] for r in f], [r["ttft_s"] for r in f], c=c, ls=ls, lw=lw, label=p)
    r0 = rows[0]
    ax.axhline(r0["deadline_s"], ls="--", c="gray", label="deadline")
    ax.axvline(r0["itl_slo"], ls=":", c="gray", label="ITL p99 target")
    ax.set_xscale("log")
    ax.set_xlabel("decode ITL p99 (s, log)")
    ax.set_ylabel("TTFT of the long prompt (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)


def cut_plot(main: list[dict], cuts: list[dict], path: Path, plt) -> None:
    policies = sorted({r["policy"] for r in cuts}, key=POLICIES.index)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))
    styles = {"aligned": "-", "arbitrary": "--", "arbitrary-replay": ":"}
    floor = {1: 1e-4, 3: 1.0}  # zeros drawn at the axis floor of the log panels
    for p in policies:
        c, m = STYLE[p]
        for kind, ls in styles.items():
            part = sorted((r for r in main + cuts if r["policy"] == p and r["cuts"] == kind),
                          key=lambda r: r["release"])
            if not part:
                continue
            xs = [r["release"] for r in part]
            values = ([r["ttft_s"] for r in part], [max(r["wasted_share"] * 100, floor[1]) for r in part],
                      [r["itl_p99_s"] for r in part], [max(r["retraction_replay_tokens"], floor[3]) for r in part])
            for ax, ys in zip(axes, values):
                ax.plot(xs, ys, ls=ls, marker=m, c=c, label=f"{p}, {kind} cuts")
    titles = ("TTFT (s; lower is better)", "FLOPs recomputed, % of the prompt's (log)",
              "decode ITL p99 (s, log; lower is better)", "tokens a retraction recomputes (mean, log)")
    for ax, t in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("release amount R (tokens per round)")
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3)
    for i in (1, 2, 3):
        axes[i].set_yscale("log")
    for i, what in ((1, "aligned and arbitrary (no replay): 0,\ndrawn at the floor"),
                    (3, "aligned: 0 (every cut is checkpointed),\ndrawn at the floor")):
        axes[i].text(0.03, 0.06, what, transform=axes[i].transAxes, fontsize=7, color="dimgray")
    axes[0].legend(fontsize=7)
    fig.suptitle("Simulated, aligned vs arbitrary cuts: " + setting_line(cuts[0]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
