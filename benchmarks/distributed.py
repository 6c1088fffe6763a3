"""Context and tensor parallelism on this machine, measured against one rank, on the built-in
Kimi Linear model, through torch.distributed (gloo).

    python -m benchmarks.distributed                 # CP: one 8,192-token prefill split across 2 ranks
    python -m benchmarks.distributed --tp            # TP: LLM.generate of 16 requests at TP=2 vs TP=1
    python -m benchmarks.distributed --tokens 4096 --repeats 1

CP (models/layers/context_parallel.py): alternating, for `--repeats` rounds, one rank with 1
thread, one rank with `--world` threads (the same cores as the split run), and `--world` ranks
of 1 thread each. Each run is its own set of processes: they load the model, warm up on a short
prompt (split the same way), then time one prefill of the prompt between barriers. Prints each
setting's minimum, the ratios, and the largest relative difference of the last token's logits
and of the final states from the one-rank run.

TP (hybridserve/parallel.py): the same three settings, each an engine in its own process
(`LLM("builtin", tensor_parallel_size=...)`, fp32, no adaptive threads) timing one
`generate()` of 16 requests (a 512-byte prompt each, 32 greedy tokens) after a warm-up;
greedy tokens compared with the one-rank run.

Writes benchmarks/results/distributed_{cp,tp}.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridserve.distributed import run_ranks
from models.batch import ForwardBatch, Memory, Segment
from models.builtin import builtin_path
from models.layers.context_parallel import context_parallel_batch
from models.loader import load_model

RESULTS = Path(__file__).parent / "results"
PAGE = 64


def prefill(model, cfg, ids: list[int], split: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Seconds of one prefill of ids (from a fresh state), its last logits and final states."""
    pages = -(-len(ids) // PAGE)
    memory = Memory(kv=[{n: torch.zeros(pages, PAGE, *s, dtype=cfg.dtype) for n, s in layer.items()}
                        for layer in cfg.kv_shapes],
                    state=[{n: torch.zeros(1, *s, dtype=dt) for n, (s, dt) in layer.items()}
                           for layer in cfg.state_shapes],
                    page_size=PAGE)
    seg = Segment(ids, 0, 0, list(range(pages)))
    batch = context_parallel_batch(seg, memory, align=PAGE) if split else ForwardBatch.build([seg], memory)
    if split:
        dist.barrier()
    start = time.perf_counter()
    logits = model(batch)
    if split:
        dist.barrier()
        last = torch.empty_like(logits)  # the prompt's last token is on the last rank
        last.copy_(logits)
        dist.broadcast(last, dist.get_world_size() - 1)
        logits = last
    seconds = time.perf_counter() - start
    states = torch.cat([buf.flatten().float() for layer in memory.state for buf in layer.values()])
    return seconds, logits[-1], states


def worker(path: str, tokens: int, dtype: str, split: bool) -> dict:
    model, cfg = load_model(path, dtype=getattr(torch, dtype))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (tokens,), generator=g).tolist()
    warm = 2 * PAGE * (dist.get_world_size() if split else 1)
    prefill(model, cfg, ids[:warm][::-1], split)
    seconds, logits, states = prefill(model, cfg, ids, split)
    return {"seconds": seconds, "logits": logits, "states": states}


def generate(world: int, threads: int, requests: int, new: int) -> dict:
    """One engine (its own process): seconds of one generate() and its tokens."""
    from hybridserve import LLM, SamplingParams

    torch.set_num_threads(threads * world)  # the engine gives each rank an N-th
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (512,), generator=g).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    with LLM("builtin", dtype="float32", tensor_parallel_size=world, adaptive_threads=False,
             enable_prefix_cache=False) as llm:
        llm.generate([[7] * 100], SamplingParams(max_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": [o.token_ids for o in outs]}


def tensor_parallel(args) -> None:
    settings = {"1 rank x 1 thread": (1, 1), f"1 rank x {args.world} threads": (1, args.world),
                f"TP={args.world}: {args.world} ranks x 1 thread": (args.world, 1)}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for rep in range(args.repeats):
        for name, (world, threads) in settings.items():
            cmd = [sys.executable, "-m", "benchmarks.distributed", "--tp-worker", str(world), str(threads)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            runs[name].append(out)
            print(f"repeat {rep + 1}: {name}: {out['seconds']:.3f} s", flush=True)
    ref = runs["1 rank x 1 thread"][0]["tokens"]
    rows = [{"setting": name, "seconds": [r["seconds"] for r in rs], "min_s": min(r["seconds"] for r in rs),
             "greedy tokens equal": "yes" if all(r["tokens"] == ref for r in rs) else "NO"}
            for name, rs in runs.items()]
    report(args, "generate() of 16 requests x (512 prompt + 32 new tokens), fp32", rows, ["greedy tokens equal"],
           "distributed_tp.json")


def report(args, what: str, rows: list[dict], columns: list[str], name: str) -> None:
    """Print the settings' minima and ratios (rows[0]: one rank x 1 thread, rows[1]: one rank
    x `world` threads) with the extra `columns`, and write them to benchmarks/results/`name`."""
    print(f"\nMEASURED: built-in Kimi Linear, {what}, minimum of {args.repeats} alternating runs\n")
    print(f"| setting | min s | speed vs 1 rank x 1 thread | vs 1 rank x {args.world} threads | "
          + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(columns))
    for r in rows:
        print(f"| {r['setting']} | {r['min_s']:.3f} | {rows[0]['min_s'] / r['min_s']:.2f}x | "
              f"{rows[1]['min_s'] / r['min_s']:.2f}x | " + " | ".join(str(r[c]) for c in columns) + " |")
    out = args.json or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", action="store_true", help="tensor parallelism (engine generate) instead of CP")
    ap.add_argument("--tokens", type=int, default=8192, help="CP: prompt tokens")
    ap.add_argument("--world", type=int, default=2, help="ranks of the split run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="CP: model dtype")
    ap.add_argument("--json", type=Path, default=None, help="output (default benchmarks/results/distributed_*.json)")
    ap.add_argument("--tp-worker", nargs=2, type=int, metavar=("WORLD", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tp_worker:
        print(json.dumps(generate(*args.tp_worker, requests=16, new=32)))
        return
    if args.tp:
        tensor_parallel(args)
        return
    path = str(builtin_path())
    settings = {  # name -> (ranks, threads per rank, split)
        "1 rank x 1 thread": (1, 1, False),
        f"1 rank x {args.world} threads": (1, args.world, False),
        f"{args.world} ranks x 1 thread (CP={args.world})": (args.world, 1, True),
    }
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for rep in range(args.repeats):
        for name, (ranks, threads, split) in settings.items():
            out = run_ranks(worker, ranks, (path, args.tokens, args.dtype, split), backend="gloo", threads=threads)
            runs[name].append(out[0])
            print(f"repeat {rep + 1}: {name}: {out[0]['seconds']:.3f} s", flush=True)
    ref = min(runs["1 rank x 1 thread"], key=lambda r: r["seconds"])

    def rel(a: torch.Tensor, b: torch.Tensor) -> str:
        return f"{float((a - b).norm() / b.norm()):.1e}"

    rows = []
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"])
        rows.append({"setting": name, "seconds": [r["seconds"] for r in rs], "min_s": best["seconds"],
                     "last logits rel diff": rel(best["logits"], ref["logits"]),
                     "final states rel diff": rel(best["states"], ref["states"])})
    report(args, f"one {args.tokens}-token prefill, {args.dtype}", rows,
           ["last logits rel diff", "final states rel diff"], "distributed_cp.json")


if __name__ == "__main__":
    main()
