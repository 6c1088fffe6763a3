"""The decode kernels over pools on 2 MB pages (state_cache/huge_pages.py) against 4 KB pages.

    python -m benchmarks.huge_pages [--repeats 100] [--threads 2] [--pool-mb 512]

Two copies of a KV pool and of a recurrent-state pool, one allocated as the engine allocates
them (advised onto huge pages) and one with torch.zeros (4 KB pages), the same contents. A
batch of 64 sequences at the peer benchmark's shapes (Qwen3-Next: 2 KV heads x 64, pages of 64
tokens, 1,024 shared + 320 own keys; GDN states 4 x 64 x 64 fp32 in six layers) is placed at
random over each pool, and the decode kernels run on one copy, then the other, alternating,
with the last-level cache swept before every call (a decode step reads more pages and states
than the cache holds, so their rows come from memory). Prints each kernel's median time per
copy and the ratio.
"""
from __future__ import annotations

import argparse
import time

import hybridserve  # noqa: F401  # isort: skip  (first: the OpenMP wait policy is read when torch loads)
import torch

from kernels import native
from state_cache import huge_pages

N, H, HKV, D, PAGE, SHARED, OWN = 64, 4, 2, 64, 64, 1024, 320
HV, K, V, LINEAR_LAYERS = 4, 64, 64, 6
SWEEP_MB = 64


def pools(pool_mb: int, huge: bool, gen: torch.Generator):
    make = (lambda s, dt: huge_pages.zeros(s, dt, "cpu")) if huge else (lambda s, dt: torch.zeros(s, dtype=dt))
    pages = pool_mb * 2**20 // (PAGE * HKV * D * 2 * 2)
    kc, vc = make((pages, PAGE, HKV, D), torch.bfloat16), make((pages, PAGE, HKV, D), torch.bfloat16)
    slots = pool_mb * 2**20 // (HV * K * V * 4 * LINEAR_LAYERS)
    states = [make((slots, HV, K, V), torch.float32) for _ in range(LINEAR_LAYERS)]
    for t in (kc, vc, *states):
        t.normal_(generator=gen)
    return kc, vc, states


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-mb", type=int, default=512, help="each pool's size (KV per K and V, states in all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    copies = {"4 KB": pools(args.pool_mb, False, gen), "2 MB": pools(args.pool_mb, True, gen)}
    for name, (kc, _, _) in copies.items():
        flags = huge_pages.mapping_flags(kc.data_ptr() + kc.nbytes // 2)
        print(f"{name} pages: the KV pool's mapping flags {' '.join(flags)}")
    kc = copies["4 KB"][0]
    own_pages = -(-OWN // PAGE)
    order = torch.randperm(kc.shape[0] - SHARED // PAGE, generator=gen)[: N * own_pages] + SHARED // PAGE
    table = torch.cat([torch.arange(SHARED // PAGE).expand(N, -1), order.view(N, own_pages)], 1)
    lens = torch.full((N,), SHARED + OWN, dtype=torch.long)
    slots = torch.randperm(copies["4 KB"][2][0].shape[0], generator=gen)[:N].sort().values
    q = torch.randn(N, H, D, generator=gen).bfloat16()
    qs = torch.randn(N, HV, K, generator=gen)
    ks = torch.nn.functional.normalize(torch.randn(N, HV, K, generator=gen), dim=-1)
    vs = torch.randn(N, HV, V, generator=gen)
    g, beta = -torch.rand(N, HV, 1, generator=gen) * 0.1, torch.rand(N, HV, generator=gen)
    sweep = torch.empty(SWEEP_MB * 2**20 // 4)
    cases = {
        "paged_decode (one layer)": lambda c: native.paged_decode(q, c[0], c[1], table, lens, D ** -0.5, D),
        f"delta_step ({LINEAR_LAYERS} layers)": lambda c: [native.delta_step(qs, ks, vs, g, beta, s, slots, K ** -0.5)
                                                           for s in c[2]],
    }
    print(f"{N} sequences, {args.threads} threads, the cache swept before each call; median of {args.repeats}\n")
    print("| kernel | 4 KB pages ms | 2 MB pages ms | 4 KB / 2 MB |\n|---|---:|---:|---:|")
    for case, run in cases.items():
        times: dict[str, list[float]] = {name: [] for name in copies}
        for i in range(2 * args.repeats):
            name = list(copies)[(i + i // 2) % 2]  # ABBA
            sweep.add_(1.0)
            t = time.perf_counter()
            run(copies[name])
            times[name].append(time.perf_counter() - t)
        small, huge = (sorted(times[n])[len(times[n]) // 2] * 1e3 for n in copies)
        print(f"| {case} | {small:.3f} | {huge:.3f} | {small / huge:.2f}x |")


if __name__ == "__main__":
    main()
