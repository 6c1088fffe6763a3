"""KDA prefill on CPU: our chunk_kda against FLA's pure-torch naive_recurrent_kda / naive_chunk_kda.

    python -m benchmarks.kernels [--lengths 4096 16384] [--repeats 3] [--threads N]

B = 1, H = HV = 4, K = V = 128, fp32, log decays uniform in [-1, 0]. Prints ms (median of
--repeats runs, interleaved), speed-ups, the relative error of ours against
naive_recurrent_kda, and our GFLOP/s against a torch fp32 matmul measured in the same run.
FLOPs are the matmul FLOPs chunk_kda executes (2 m n k per product, see chunk_flops);
its elementwise work is not counted. Writes benchmarks/results/kernels.json (+ .png).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kernels.kda import chunk_kda
from kernels.kda.common import CHUNK
from kernels.kda.intra import SUB

RESULTS = Path(__file__).parent / "results"


def chunk_flops(T: int, HV: int, K: int, V: int, C: int = CHUNK) -> float:
    """Matmul FLOPs of chunk_kda for one sequence of T tokens (whole chunks)."""
    levels = sum(b for b in (C // 2, C // 4, C // 8, C // 16, C // 32) if b >= SUB)
    per_chunk = (4 * C * SUB * K  # intra: diagonal sub-chunk blocks, k and q rows
                 + 2 * C * levels * K  # intra: blocks across sub-chunks, k and q rows
                 + sum(2 * C * b * b for b in (1, 2, 4, 8, 16, 32))  # (I + A)^-1 by doubling
                 + 2 * C * C * (V + K)  # U, W
                 + 2 * 2 * C * K * V  # scan: W S0 and k_out^T D
                 + 2 * C * C * V + 2 * C * K * V)  # output: A_qk D and q S0
    return HV * -(-T // C) * per_chunk


def inputs(T: int, HV: int = 4, K: int = 128, V: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(T, HV, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen)
    g = -torch.rand(T, HV, K, generator=gen)
    beta = torch.rand(T, HV, generator=gen)
    return q, k, v, g, beta


def matmul_peak(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of an n x n x n torch matmul."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(T: int, repeats: int) -> dict:
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda
    q, k, v, g, beta = inputs(T)
    batched = [x[None] for x in (q, k, v, g, beta)]
    runs = {
        "chunk_kda": lambda: chunk_kda(q, k, v, g, beta, output_final_state=True),
        "naive_recurrent_kda": lambda: naive_recurrent_kda(*batched, output_final_state=True),
        "naive_chunk_kda": lambda: naive_chunk_kda(*batched, output_final_state=True),
    }
    runs["chunk_kda"]()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].append(_seconds(fn))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    o, final = runs["chunk_kda"]()
    o_ref, final_ref = runs["naive_recurrent_kda"]()
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    return {
        "T": T, "ms": ms, "ms_all": {n: [1e3 * x for x in t] for n, t in times.items()},
        "speedup_vs_naive_recurrent": ms["naive_recurrent_kda"] / ms["chunk_kda"],
        "speedup_vs_naive_chunk": ms["naive_chunk_kda"] / ms["chunk_kda"],
        "rel_err_o": rel(o, o_ref[0]), "rel_err_final_state": rel(final, final_ref),
        "gflop": chunk_flops(T, 4, 128, 128) / 1e9,
        "gflops": chunk_flops(T, 4, 128, 128) / ms["chunk_kda"] / 1e6,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["chunk_kda", "naive_recurrent_kda", "naive_chunk_kda"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(results))]
        ax.bar(xs, [r["ms"][name] for r in results], width, label=name)
    ax.set_xticks([j + width for j in range(len(results))], [f"T={r['T']}" for r in results])
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.5 * min(r["ms"]["chunk_kda"] for r in results))
    ax.set_ylabel("ms (median)")
    ax.set_title("KDA prefill on CPU, HV=4, K=V=128, fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = matmul_peak(args.threads)
    results = [bench(T, args.repeats) for T in args.lengths]
    print(f"threads={args.threads} fp32 matmul peak {peak:.1f} GFLOP/s "
          f"(load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
    print(f"{'T':>6} {'chunk_kda':>10} {'naive_rec':>10} {'naive_chunk':>11} {'x rec':>6} {'x chunk':>7} "
          f"{'rel err o':>9} {'GFLOP/s':>8} {'% peak':>6}")
    for r in results:
        ms = r["ms"]
        print(f"{r['T']:>6} {ms['chunk_kda']:>10.1f} {ms['naive_recurrent_kda']:>10.1f} "
              f"{ms['naive_chunk_kda']:>11.1f} {r['speedup_vs_naive_recurrent']:>6.1f} "
              f"{r['speedup_vs_naive_chunk']:>7.1f} {r['rel_err_o']:>9.1e} {r['gflops']:>8.1f} "
              f"{100 * r['gflops'] / peak:>6.1f}")
    RESULTS.mkdir(exist_ok=True)
    meta = {"threads": args.threads, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "matmul_peak_gflops": peak, "torch": torch.__version__, "machine": platform.processor(),
            "config": {"B": 1, "H": 4, "HV": 4, "K": 128, "V": 128, "dtype": "float32",
                       "g": "uniform [-1, 0]", "repeats": args.repeats}}
    (RESULTS / "kernels.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    try:
        plot(results, RESULTS / "kernels.png")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
