"""Decode steps with fused projections against separate ones, alternating in one process.

    python -m benchmarks.fused_projections [--models qwen3-next builtin] [--sequences 64] [--threads 2]
                                           [--same-prompt] [--compare projections|bodies]

For each model, `--sequences` requests of `--prompt` tokens are prefilled, then every decode
step runs either with the current projections (models/layers/linear.py's fused_linear and the
padded MoE path for any batch of at most PAD_FREE_ROWS rows per expert) or with separate
matmuls and the old padding rule (balanced routing only), switching at each step, so the two
see the same contexts and the same drift of a shared machine. With `--compare bodies` the two
ways are the layers' one-call decode bodies (models/batch.py FUSED_DECODE: kernels/native.py
delta_decode, attention_decode, mla_decode and mamba_decode, which give the same bits) against
their kernels called one by one from Python. Prints the median and 20th
percentile step of each and the ratio of the medians. With --same-prompt every sequence is
the same, so every token picks the same experts: the most skewed routing, where the padding
rule matters most. Also times one bf16 matmul of
`--sequences` rows with 8 outputs against one with 256 (the fixed cost the fusion saves).
Models: `qwen3-next` (the peer benchmark's bf16 checkpoint, benchmarks/peer_models.py, built
once under --cache) and `builtin` (the built-in Kimi model, fp32; `--dtype` sets both).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import models.batch
import models.layers.linear as linear
import models.layers.mlp as mlp
from benchmarks.peer_models import build


def set_fused(on: bool, pad_free_rows: int, compare: str = "projections") -> None:
    if compare == "bodies":
        models.batch.FUSED_DECODE = on
        return
    linear.ENABLED = on
    mlp.PAD_FREE_ROWS = pad_free_rows if on else 0


def decode_steps(model: str, args) -> dict[bool, list[float]]:
    from hybridserve import LLM, SamplingParams

    path, dtype = ("builtin", "float32") if model == "builtin" else (str(build(model, args.cache)[0]), "bfloat16")
    dtype = args.dtype or dtype
    llm = LLM(path, dtype=dtype, enable_prefix_cache=False, max_running=args.sequences, memory_gb=2.0)
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    same = [rng.randrange(vocab) for _ in range(args.prompt)]
    for _ in range(args.sequences):
        prompt = same if args.same_prompt else [rng.randrange(vocab) for _ in range(args.prompt)]
        eng.add_request(eng.validate(prompt, sp), sp)
    while any(not r.output_ids for r, *_ in eng.requests.values()):  # every prompt prefilled
        eng.step()
    pad_free_rows, times = mlp.PAD_FREE_ROWS, {True: [], False: []}
    try:
        for i in range(args.steps):
            fused = i % 2 == 1
            set_fused(fused, pad_free_rows, args.compare)
            t0 = time.perf_counter()
            eng.step()
            times[fused].append(time.perf_counter() - t0)
    finally:
        set_fused(True, pad_free_rows, args.compare)
    return times


def matmul_us(rows: int, outs: int, repeats: int = 2000) -> float:
    x, w = torch.randn(rows, 256).bfloat16(), torch.randn(outs, 256).bfloat16()
    for _ in range(50):
        F.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return (time.perf_counter() - t0) / repeats * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=["qwen3-next", "builtin"], default=["qwen3-next", "builtin"])
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed (half each way)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--same-prompt", action="store_true",
                    help="one prompt for every sequence: every token routed alike (the most skewed MoE batch)")
    ap.add_argument("--compare", choices=["projections", "bodies"], default="projections",
                    help="fused projections against separate ones, or the layers' one-call decode bodies against "
                         "their kernels one by one")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="both models' dtype (default: as above)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hybridserve-peers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    narrow, wide = matmul_us(args.sequences, 8), matmul_us(args.sequences, 256)
    print(f"bf16 matmul of {args.sequences} x 256 rows: 8 outputs {narrow:.1f} us, 256 outputs {wide:.1f} us")
    print("| model | separate median ms | fused median ms | separate p20 ms | fused p20 ms | speed-up (medians) |")
    print("|---|---:|---:|---:|---:|---:|")
    for model in args.models:
        t = decode_steps(model, args)
        med = {f: statistics.median(v) * 1e3 for f, v in t.items()}
        p20 = {f: sorted(v)[len(v) // 5] * 1e3 for f, v in t.items()}
        print(f"| {model} | {med[False]:.1f} | {med[True]:.1f} | {p20[False]:.1f} | {p20[True]:.1f} | "
              f"{med[False] / med[True]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
