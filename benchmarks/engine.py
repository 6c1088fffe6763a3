"""The engine on the built-in model, CPU, side by side in one run.

    python -m benchmarks.engine [--requests 64] [--prefix 1024] [--suffix 256] [--new 64]
                                [--threads N] [--overhead-batch 32] [--reference-requests 8]

1. Throughput: `--requests` prompts sharing a `--prefix`-token prefix with distinct
   `--suffix`-token tails, `--new` greedy tokens each. hybridserve (continuous batching,
   state prefix cache) against transformers' `generate` called per request on the same
   weights. transformers is timed on the first `--reference-requests` requests (it is
   sequential: its time per request does not depend on the others) and extrapolated; its
   greedy tokens are compared with ours on those requests.
2. Engine overhead: `--overhead-batch` requests decoding together; the share of each
   decode step spent outside the model forward (batch building, sampling, scheduling,
   cache bookkeeping, detokenising).
Writes benchmarks/results/engine.json.
"""
from __future__ import annotations

import hybridserve  # noqa: F401  # isort: skip  (first: the OpenMP wait policy is read when torch loads)
import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def prompts(n: int, prefix: int, suffix: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(prefix)]
    return [shared + [rng.randrange(vocab) for _ in range(suffix)] for _ in range(n)]


def run_engine(batch: list[list[int]], new: int):
    from hybridserve import LLM, SamplingParams

    llm = LLM("builtin", dtype="float32", memory_gb=2.0, max_running=64, policy="serial",
              cost_profile="builtin_cpu")
    llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    llm.engine.scheduler.flush_cache()
    t0 = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    return time.perf_counter() - t0, [o.token_ids for o in outs], llm


def run_transformers(batch: list[list[int]], new: int):
    from tests.utils import import_torch_reference

    mod = import_torch_reference("transformers.models.kimi_linear.modeling_kimi_linear")
    from models.builtin import builtin_path

    ref = mod.KimiLinearForCausalLM.from_pretrained(builtin_path(), dtype=torch.float32).eval()
    outs, t0 = [], time.perf_counter()
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p])
            g = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
            outs.append(g[0, len(p):].tolist())
    return time.perf_counter() - t0, outs


def overhead(llm, batch_size: int, steps: int = 20) -> dict:
    """Wall time of engine.step() vs the model forward inside it, for decode-only steps."""
    from hybridserve.sampling import SamplingParams

    eng = llm.engine
    fwd = []
    orig = eng.model.forward

    def timed(batch):
        t0 = time.perf_counter()
        out = orig(batch)
        fwd.append(time.perf_counter() - t0)
        return out

    for p in prompts(batch_size, 0, 64, seed=1):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=steps + 50, ignore_eos=True))
    while any(r.status.value != "decode" for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.model.forward = timed
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    eng.model.forward = orig
    step, forward = statistics.median(walls), statistics.median(fwd[-steps:])
    return {"batch": batch_size, "step_ms": step * 1e3, "forward_ms": forward * 1e3,
            "overhead_share": (step - forward) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reference-requests", type=int, default=8)
    ap.add_argument("--overhead-batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch = prompts(args.requests, args.prefix, args.suffix)
    t_ours, ours, llm = run_engine(batch, args.new)
    k = min(args.reference_requests, args.requests)
    t_ref_k, ref = run_transformers(batch[:k], args.new)
    t_ref = t_ref_k * args.requests / k
    tokens = args.requests * args.new
    same = sum(a == b for a, b in zip(ours[:k], ref))
    over = overhead(llm, args.overhead_batch)
    result = {
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "workload": vars(args),
        "hybridserve_s": t_ours, "transformers_s_extrapolated": t_ref, "transformers_s_measured": t_ref_k,
        "transformers_requests_timed": k,
        "hybridserve_tok_s": tokens / t_ours, "transformers_tok_s": tokens / t_ref,
        "speedup": t_ref / t_ours, "greedy_identical": f"{same}/{k}", "overhead": over,
    }
    print(f"throughput: hybridserve {tokens / t_ours:.1f} tok/s, transformers {tokens / t_ref:.1f} tok/s "
          f"(timed on {k} requests) -> {t_ref / t_ours:.2f}x; greedy identical on {same}/{k}")
    print(f"decode step at batch {over['batch']}: {over['step_ms']:.1f} ms, forward {over['forward_ms']:.1f} ms, "
          f"overhead {100 * over['overhead_share']:.1f}%")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
