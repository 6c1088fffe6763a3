"""The bf16 projection kernel against torch's matmul, alternating in one process.

    python -m benchmarks.gemm [--threads 2] [--repeats 30]

For the projection shapes of the peer benchmark's Qwen3-Next (hidden 256: fused q/k/v/z, out,
MoE router + shared expert, lm_head) at decode batches (64 rows) and prefill rounds (about 6,000
rows), times one call of:
  ours         kernels/native.py's linear_bf16, what models/layers/linear.py's `linear` runs
               (kernels/gemm/cpu_gemm.cpp, the weight packed once; oneDNN's micro-kernels with
               AMX, its own AVX-512 BF16 or AVX2 ones elsewhere)
  torch-same   F.linear at a row count it has seen: oneDNN's matmul primitive already made
  torch-new    F.linear at a row count it has not seen, as each serving round brings: the
               primitive is made inside the call
  torch-pad    F.linear on the rows copied into a buffer padded to a multiple of 256 rows
               (BUCKET): a primitive per bucket, made once; the copy is counted
Rows differ by one from call to call for `ours`, `torch-new` and `torch-pad` (what an engine
gives them). The candidates alternate, the minimum over `--repeats` is printed with the
ratios to `ours`, and the outputs are checked to be the same bits (oneDNN's micro-kernels)
or within a bf16 step (our own ones, which sum in another order). Freed memory is kept, as
the engine keeps it (hybridserve/host.py).

`--fp32`: the fp32 micro-kernel (`linear_f32`: AVX-512 BF16 without AMX, AVX2 without AVX-512) against
torch's fp32 matmul (MKL's sgemm) at decode and prefill sizes, with each one's largest error
against the fp64 product.
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from hybridserve.host import keep_freed_memory
from kernels import native

BUCKET = 256

# (rows, outputs, inputs): the Qwen3-Next peer checkpoint's projections
SHAPES = [(64, 776, 256), (64, 256, 256), (64, 521, 256), (64, 4096, 256),
          (6000, 776, 256), (6000, 256, 256), (6000, 521, 256)]


def row(rows: int, outs: int, ins: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(rows + outs)
    x = torch.randn(rows + repeats + 2, ins, generator=gen).bfloat16()
    w = torch.randn(outs, ins, generator=gen).bfloat16()
    native.assert_torch_bf16_bits(native.linear_bf16(x[:rows], w), F.linear(x[:rows], w))
    ours_rows, torch_rows, pad_rows = itertools.count(rows), itertools.count(rows + 1), itertools.count(rows)

    def padded():
        n = next(pad_rows)
        buf = x.new_empty(-(-n // BUCKET) * BUCKET, ins)
        buf[:n] = x[:n]
        return F.linear(buf, w)[:n]

    assert torch.equal(padded(), F.linear(x[:rows], w)), "torch's paths disagree"
    fns = {"ours": lambda: native.linear_bf16(x[:next(ours_rows)], w),
           "torch-same": lambda: F.linear(x[:rows], w),  # torch has seen `rows` only
           "torch-new": lambda: F.linear(x[:next(torch_rows)], w),
           "torch-pad": padded}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# (rows, outputs, inputs) for --fp32: decode and prefill sizes, narrow and wide outputs
F32_SHAPES = [(1, 1024, 256), (64, 1024, 256), (37, 520, 1024), (4096, 1024, 256), (4096, 256, 1024),
              (4096, 3000, 256), (64, 1096, 256), (64, 256, 512), (64, 4096, 256), (16000, 1096, 256),
              (16000, 256, 512), (16000, 512, 256)]


def f32_rows(repeats: int) -> None:
    """--fp32: the fp32 micro-kernel (linear_f32) against torch's F.linear (MKL's sgemm), alternating,
    and the largest difference from the fp64 product relative to its largest value, for each."""
    print(f"{'rows x outs x ins':>21}  {'ours':>9}  {'torch':>9}  ours/torch  {'GFLOP/s':>7}  err ours  err torch")
    for rows, outs, ins in F32_SHAPES:
        gen = torch.Generator().manual_seed(rows + outs)
        x, w, b = torch.randn(rows, ins, generator=gen), torch.randn(outs, ins, generator=gen), torch.randn(outs)
        exact = F.linear(x.double(), w.double(), b.double())
        fns = {"ours": native.linear_f32, "torch": F.linear}
        err = {n: float((f(x, w, b).double() - exact).abs().max() / exact.abs().max()) for n, f in fns.items()}
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(repeats):
            for name, f in fns.items():
                t0 = time.perf_counter()
                f(x, w, b)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{rows:>7} x {outs:>5} x {ins:>4}  {best['ours'] * 1e6:>7.0f}us  {best['torch'] * 1e6:>7.0f}us  "
              f"{best['ours'] / best['torch']:>10.2f}  {2 * rows * outs * ins / best['ours'] / 1e9:>7.0f}  "
              f"{err['ours']:>8.1e}  {err['torch']:>9.1e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--fp32", action="store_true", help="the fp32 kernel against torch's fp32 matmul instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    if args.fp32:
        if not native.fp32_micro_kernel():
            raise SystemExit("the fp32 kernel does not run on this CPU (only AVX-512 BF16 without AMX, or AVX2 "
                             "without AVX-512) or is not built")
        print(f"{args.threads} threads, fp32, minimum of {args.repeats} alternating calls")
        f32_rows(args.repeats)
        return
    if native._bf16_gemm() is None:
        raise SystemExit("the bf16 kernels do not run on this CPU (neither AMX nor AVX2) or are not built")
    print(f"{args.threads} threads, minimum of {args.repeats} alternating calls")
    print(f"{'rows x outs x ins':>21}  {'ours':>8}  {'torch-same':>10}  {'torch-new':>9}  {'torch-pad':>9}  "
          "same/ours  new/ours  pad/ours")
    for rows, outs, ins in SHAPES:
        t = row(rows, outs, ins, args.repeats)
        us = {name: f"{v * 1e6:.0f}us" for name, v in t.items()}
        print(f"{rows:>7} x {outs:>5} x {ins:>4}  {us['ours']:>8}  {us['torch-same']:>10}  {us['torch-new']:>9}  "
              f"{us['torch-pad']:>9}  {t['torch-same'] / t['ours']:>9.2f}  {t['torch-new'] / t['ours']:>8.2f}  "
              f"{t['torch-pad'] / t['ours']:>8.2f}")


if __name__ == "__main__":
    main()
