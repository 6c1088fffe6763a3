"""Paged prefill attention on CPU: the compiled kernel against the SDPA path, side by side.

    python -m benchmarks.attention [--repeats 5] [--threads 2]

bf16 pages of 64 tokens, 4 query / 2 KV heads of 64 (the peer benchmark's Qwen3-Next). Each
case times `paged_attention` with the compiled prefill kernel and with it switched off
(the grouped SDPA path), alternating, and prints the minimum of --repeats runs, the ratio
and the largest difference of the two outputs.
"""
from __future__ import annotations

import argparse
import time

import torch

import kernels.attention.torch as attention

CASES = [  # (sequences, keys per sequence, new queries per sequence)
    (2, 1280, 1024),  # a cached prefix of 256 keys
    (2, 1280, 1280),  # no prefix: SDPA's own causal mask
    (8, 1280, 256),  # the workload's own suffixes after a prefix hit
]


def inputs(n: int, keys: int, new: int, page: int = 64, h: int = 4, hkv: int = 2, d: int = 64):
    gen = torch.Generator().manual_seed(0)
    pages = n * -(-keys // page)
    k, v = (torch.randn(pages, page, hkv, d, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(n * new, h, d, generator=gen).bfloat16()
    return (q, k, v, torch.arange(pages).view(n, -1), torch.arange(n + 1) * new, torch.full((n,), keys), d**-0.5)


def seconds(x) -> float:
    t0 = time.perf_counter()
    attention.paged_attention(*x)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    compiled = attention.paged_prefill
    print(f"{'sequences x keys, new queries':>30} {'compiled ms':>12} {'SDPA ms':>9} {'SDPA / compiled':>16} "
          f"{'max diff':>9}")
    for n, keys, new in CASES:
        x = inputs(n, keys, new)
        times: dict[str, list[float]] = {"compiled": [], "sdpa": []}
        outs = {}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, kernel in (("compiled", compiled), ("sdpa", lambda *a: None)):
                attention.paged_prefill = kernel
                outs[name] = attention.paged_attention(*x)
                times[name].append(seconds(x))
        attention.paged_prefill = compiled
        c, s = min(times["compiled"][1:]) * 1e3, min(times["sdpa"][1:]) * 1e3
        diff = (outs["compiled"].float() - outs["sdpa"].float()).abs().max().item()
        print(f"{f'{n} x {keys}, {new}':>30} {c:12.1f} {s:9.1f} {s / c:15.2f}x {diff:9.1e}")


if __name__ == "__main__":
    main()
