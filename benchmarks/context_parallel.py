"""Context-parallel prefill on this machine: one long prompt of the built-in Kimi Linear model
prefilled by one rank and split across `--world` gloo ranks (models/layers/context_parallel.py).

    python -m benchmarks.context_parallel                      # 8,192 tokens, 3 repeats
    python -m benchmarks.context_parallel --tokens 4096 --repeats 1

Runs, alternating, for `--repeats` rounds: one rank with 1 thread, one rank with `--world`
threads (the same cores as the split run), and `--world` ranks of 1 thread each. Each run is
its own set of processes: they load the model, warm up on a short prompt (split the same
way), then time one prefill of the prompt between barriers. Prints each setting's minimum,
the ratios, and the largest relative difference of the last token's logits and of the final
states from the one-rank run. Writes benchmarks/results/context_parallel.json.
"""
from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    ap.add_argument("--world", type=int, default=2, help="ranks of the split run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", type=Path, default=RESULTS / "context_parallel.json")
    args = ap.parse_args(argv)
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
    rows = []
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"])
        rows.append({"setting": name, "seconds": [r["seconds"] for r in rs], "min_s": best["seconds"],
                     "speedup_vs_1x1": ref["seconds"] / best["seconds"],
                     "logits_rel_diff": float((best["logits"] - ref["logits"]).norm() / ref["logits"].norm()),
                     "states_rel_diff": float((best["states"] - ref["states"]).norm() / ref["states"].norm())})
    two = rows[1]["min_s"]
    print(f"\nMEASURED: built-in Kimi Linear ({args.dtype}), one {args.tokens}-token prefill, "
          f"minimum of {args.repeats} alternating runs\n")
    print("| setting | min s | speed vs 1 rank x 1 thread | vs 1 rank x "
          f"{args.world} threads | last logits rel diff | final states rel diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setting']} | {r['min_s']:.3f} | {r['speedup_vs_1x1']:.2f}x | {two / r['min_s']:.2f}x | "
              f"{r['logits_rel_diff']:.1e} | {r['states_rel_diff']:.1e} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
