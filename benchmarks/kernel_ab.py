"""The compiled CPU kernels of another revision against this checkout's, alternating in one process.

    python -m benchmarks.kernel_ab --rev HEAD~1 [--repeats 40] [--threads 2] [--only decode,conv]
    python -m benchmarks.kernel_ab --old PATH/TO/hybridserve_cpu_<hash>.so

Two processes on a shared machine measure the machine as much as the change: here the same
run spreads 1.5-2x from one minute to the next. So both builds' modules are loaded into one
process and each case calls them alternately on the same inputs (the old module's state
arguments on a copy), and the minimum over `--repeats` calls is compared. `--rev` checks the
revision out into a temporary worktree and builds its module there (a few minutes, once per
revision: the build is cached like any other); `--old` loads a module built before.

    python -m benchmarks.kernel_ab --old PATH --engine builtin [--kernels paged_prefill,paged_decode]

`--engine MODEL` (builtin, or a peer checkpoint: qwen3-next, nemotron-h, built under
`--cache`) runs the peer benchmark's workload once through the engine instead, every call of
the named kernels made on both modules (which goes first alternating from call to call; a
kernel that advances states in place starts from the same states on both; the engine carries
on with the new module's outputs and states), and prints each kernel's summed time per
module: a change measured on the calls a real run makes, with no other engine code in the
difference, where whole runs side by side spread more than the change.

    python -m benchmarks.kernel_ab --old PATH --engine qwen3-next --steps 240

`--steps N` with `--engine` times whole decode steps instead: the workload's prompts are
prefilled, then N decode steps alternate the module step by step (ABBA), and each module's mean
and median step, and each kernel's time a step, are printed. A decode step reads more KV pages
and recurrent states than the caches hold, so this is the measure for a change to a kernel bound
by memory latency: above, a kernel's second call in a row finds the rows its first call brought in.

The cases are the decode-step and prefill kernels at the peer benchmark's sizes (64 sequences
of 1,024 shared + 320 own keys; prefill steps of 256-query segments over the 1,024 shared keys,
or of whole 1,280-query sequences with nothing cached,
alone or beside decode rows; the built-in Kimi model's and Qwen3-Next's layer shapes), the
chunkwise prefills (KDA, GDN, Mamba2's SSD) and the conv prefill at the models' widths, and the
bf16 projection and MoE layer, each module packing its own weights. In `--engine` mode both
modules get the engine's arguments, packed weights included, so kernels taking those compare
only between builds that pack alike. Each prints both times, new / old, and the largest
difference between the outputs (0: the same bits). A case the old module cannot run (a kernel
it does not have, or another signature) is listed as skipped with the reason.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from hybridserve.host import keep_freed_memory
from kernels import native

ROOT = Path(__file__).resolve().parent.parent
EMPTY = torch.empty(0)

# name -> (inputs(gen) -> tuple, call(ext, *inputs) -> tensor or tuple of tensors); inputs that a
# call writes in place (states) are cloned for each module
Case = tuple[Callable[[torch.Generator], tuple], Callable[..., object], tuple[int, ...]]


def decode_case(layout: str, dtype: torch.dtype, shared: int, own: int, page: int = 64, n: int = 64) -> Case:
    h, hkv, dk, dv = (4, 1, 160, 128) if layout == "mla" else (4, 2, 64, 64)

    def inputs(gen):
        width = (shared + own + page - 1) // page
        kc = torch.randn(n * width + 1, page, hkv, dk, generator=gen).to(dtype)
        vc = kc if layout == "mla" else torch.randn(kc.shape, generator=gen).to(dtype)
        table = torch.arange(n * width).view(n, width) + 1  # each sequence its own pages
        table[:, : shared // page] = torch.arange(shared // page)  # then the shared ones first
        return torch.randn(n, h, dk, generator=gen).to(dtype), kc, vc, table, torch.full((n,), shared + own)

    return inputs, lambda ext, q, kc, vc, table, lens: ext.paged_decode(q, kc, vc, table, lens, 0.1, dv), ()


def prefill_case(layout: str, dtype: torch.dtype, prefills: int, decodes: int, shared: int = 1024, own: int = 256,
                 page: int = 64) -> Case:
    """A mixed step as the engine runs it: `prefills` segments of `own` queries and `decodes` decode
    rows, every sequence past the same `shared` cached keys (its first pages shared)."""
    h, hkv, dk, dv = (4, 4, 96, 64) if layout == "mla-expanded" else (4, 2, 64, 64)
    n = prefills + decodes

    def inputs(gen):
        width = (shared + own + 64 + page - 1) // page
        kc = torch.randn(n * width + 1, page, hkv, dk, generator=gen).to(dtype)
        vc = torch.randn(n * width + 1, page, hkv, dv, generator=gen).to(dtype)
        table = torch.arange(n * width).view(n, width) + 1
        table[:, : shared // page] = torch.arange(shared // page)
        q_lens = torch.tensor([own] * prefills + [1] * decodes)
        lens = torch.tensor([shared + own] * prefills + [shared + own + 32] * decodes)
        cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0))
        return torch.randn(int(cu[-1]), h, dk, generator=gen).to(dtype), kc, vc, table, cu, lens

    return inputs, lambda ext, q, kc, vc, table, cu, lens: ext.paged_prefill(q, kc, vc, table, cu, lens, 0.1, dv), ()


def conv_case(dtype: torch.dtype, channels: int, n: int = 64, width: int = 4) -> Case:
    def inputs(gen):
        x = torch.randn(n, channels + 100, generator=gen).bfloat16()[:, :channels]  # a projection's columns
        state = torch.randn(2 * n, channels, width - 1, generator=gen).to(dtype)
        return x, torch.randn(channels, width, generator=gen), state, torch.randperm(2 * n, generator=gen)[:n]

    return inputs, lambda ext, x, w, state, slots: ext.conv_step(x, w, EMPTY, state, slots, True), (2,)


def conv_prefill_case(dtype: torch.dtype, channels: int, row: int, seqs: int = 8, length: int = 1280) -> Case:
    """A causal conv1d prefill with silu over `channels` of projection rows `row` wide (read in
    place, as the layers pass them): NemotronH's 576 of 1,096 (fp32), Qwen3-Next's 768 of 776."""
    cu = torch.arange(seqs + 1) * length

    def inputs(gen):
        x = torch.randn(seqs * length, row, generator=gen).to(dtype)[:, :channels]
        return x, torch.randn(channels, 4, generator=gen), torch.zeros(seqs, channels, 3)

    def call(ext, x, w, state):
        return ext.causal_conv1d(x, w, EMPTY, state, cu, torch.zeros(0, 2, dtype=torch.long), True)

    return inputs, call, ()


def delta_case(kind: str, n: int = 64) -> Case:
    h, hv, d = (4, 4, 64) if kind == "kda" else (2, 4, 64)

    def inputs(gen):
        q, k = (torch.nn.functional.normalize(torch.randn(n, h, d, generator=gen), dim=-1) for _ in range(2))
        g = -torch.rand(n, hv, d if kind == "kda" else 1, generator=gen)
        state = torch.randn(2 * n, hv, d, d, generator=gen) * 0.1
        return (q, k, torch.randn(n, hv, d, generator=gen), g, torch.rand(n, hv, generator=gen), state,
                torch.randperm(2 * n, generator=gen)[:n])

    return inputs, lambda ext, q, k, v, g, b, state, slots: ext.delta_step(q, k, v, g, b, state, slots, d**-0.5), (5,)


def chunk_case(kind: str, dtype: torch.dtype, seqs: int, length: int) -> Case:
    """A chunkwise prefill from zero states: the delta rule (kda: a decay per channel, gdn: per head;
    the models' heads of 64) or Mamba2's SSD (NemotronH's 8 heads of 64, one group of 32 channels)."""
    t = seqs * length
    cu = torch.arange(seqs + 1) * length
    none = torch.zeros(0, 2, dtype=torch.int64)

    if kind == "ssd":
        def ssd_inputs(gen):
            return (torch.randn(t, 8, 64, generator=gen).to(dtype), torch.rand(t, 8, generator=gen) * 0.1,
                    -torch.rand(8, generator=gen), *(torch.randn(t, 1, 32, generator=gen).to(dtype) for _ in range(2)),
                    torch.randn(8, generator=gen), torch.zeros(seqs, 8, 64, 32))

        def ssd(ext, x, dt, A, B, C, D, state):
            return ext.chunk_ssd(x, dt, A, B, C, D, state, cu, none, 128)

        return ssd_inputs, ssd, (6,)
    h, hv = (4, 4) if kind == "kda" else (2, 4)

    def delta_inputs(gen):
        q, k = (torch.nn.functional.normalize(torch.randn(t, h, 64, generator=gen), dim=-1).to(dtype) for _ in range(2))
        g = -torch.rand(t, hv, 64 if kind == "kda" else 1, generator=gen) * 0.5
        return (q, k, torch.randn(t, hv, 64, generator=gen).to(dtype), g, torch.rand(t, hv, generator=gen),
                torch.zeros(seqs, hv, 64, 64))

    return delta_inputs, lambda ext, q, k, v, g, b, state: ext.chunk_delta_rule(
        q, k, v, g, b, state, cu, none, 64**-0.5, -20.0), (5,)


def linear_case(rows: int, outs: int, ins: int = 256) -> Case:
    packs: dict[int, torch.Tensor] = {}

    def call(ext, x, w):
        if id(ext) not in packs:  # once per module, as the engine packs a weight once
            packs[id(ext)] = ext.pack_bf16(w)
        return ext.linear_bf16(x, packs[id(ext)], outs, EMPTY)

    return lambda gen: (torch.randn(rows, ins, generator=gen).bfloat16(),
                        torch.randn(outs, ins, generator=gen).bfloat16()), call, ()


def moe_case(rows: int, experts: int = 8, top: int = 2, dim: int = 256, inter: int = 128,
             dtype: torch.dtype = torch.bfloat16) -> Case:
    """A MoE layer of the built-in model's shape: `rows` tokens, each to `top` of `experts`, and a
    shared expert on every token (moe_bf16, or moe_f32 for fp32)."""
    packs: dict[int, tuple] = {}
    kind = "bf16" if dtype == torch.bfloat16 else "f32"

    def inputs(gen):
        x = torch.randn(rows, dim, generator=gen).to(dtype)
        idx = torch.stack([torch.randperm(experts, generator=gen)[:top] for _ in range(rows)])
        weight = torch.rand(rows, top, generator=gen).to(dtype)
        gate_up, down = (torch.randn(experts + 1, *shape, generator=gen).to(dtype) * 0.1
                         for shape in ((2 * inter, dim), (dim, inter)))
        return x, idx, weight, gate_up, down

    def call(ext, x, idx, weight, gate_up, down):
        pack, run = getattr(ext, f"pack_experts_{kind}"), getattr(ext, f"moe_{kind}")
        if id(ext) not in packs:  # once per module, as the engine packs the experts once
            packs[id(ext)] = (*pack(gate_up[:-1], down[:-1]), *pack(gate_up[-1:], down[-1:]))
        gu, dn, sgu, sdn = packs[id(ext)]
        return run(x, idx, weight, gu, dn, "silu", sgu, sdn, EMPTY)

    return inputs, call, ()


def norm_case(rows: int, dim: int = 256) -> Case:
    return (lambda gen: (torch.randn(rows, dim, generator=gen).bfloat16(), torch.randn(dim, generator=gen)),
            lambda ext, x, w: ext.add_rms_norm(x, x, w, 1e-6, 0.0, True), ())


CASES: dict[str, Case] = {
    "decode mla bf16 1024+320": decode_case("mla", torch.bfloat16, 1024, 320),
    "decode mla bf16 0+320": decode_case("mla", torch.bfloat16, 0, 320),
    "decode gqa bf16 1024+320": decode_case("gqa", torch.bfloat16, 1024, 320),
    "decode gqa fp32 0+320": decode_case("gqa", torch.float32, 0, 320),
    "decode gqa bf16 0+1344": decode_case("gqa", torch.bfloat16, 0, 1344),
    "prefill gqa bf16 8x256 + 56 decode": prefill_case("gqa", torch.bfloat16, 8, 56),
    "prefill gqa bf16 16x256": prefill_case("gqa", torch.bfloat16, 16, 0),
    "prefill mla-expanded bf16 16x256": prefill_case("mla-expanded", torch.bfloat16, 16, 0),
    "prefill gqa bf16 4x1280, no prefix": prefill_case("gqa", torch.bfloat16, 4, 0, shared=0, own=1280),
    "prefill gqa fp32 4x1280, no prefix": prefill_case("gqa", torch.float32, 4, 0, shared=0, own=1280),
    "conv prefill fp32 576 of 1096": conv_prefill_case(torch.float32, 576, 1096),
    "conv prefill bf16 768 of 776": conv_prefill_case(torch.bfloat16, 768, 776),
    "conv_step bf16 768": conv_case(torch.bfloat16, 768),
    "conv_step fp32 768": conv_case(torch.float32, 768),
    "delta_step kda": delta_case("kda"),
    "delta_step gdn": delta_case("gdn"),
    "chunk kda bf16 16x256": chunk_case("kda", torch.bfloat16, 16, 256),
    "chunk gdn bf16 16x256": chunk_case("gdn", torch.bfloat16, 16, 256),
    "chunk gdn bf16 4x1280": chunk_case("gdn", torch.bfloat16, 4, 1280),
    "chunk ssd fp32 4x1280": chunk_case("ssd", torch.float32, 4, 1280),
    "linear 64 x 256 -> 776": linear_case(64, 776),
    "linear 6000 x 256 -> 776": linear_case(6000, 776),
    "moe 64 tokens, 8 experts top-2 + shared": moe_case(64),
    "moe 4096 tokens, 8 experts top-2 + shared": moe_case(4096),
    "moe fp32 64 tokens, 8 experts top-2 + shared": moe_case(64, dtype=torch.float32),
    "moe fp32 4096 tokens, 8 experts top-2 + shared": moe_case(4096, dtype=torch.float32),
    "add_rms_norm 64 x 256": norm_case(64),
}


def build_rev(rev: str) -> Path:
    """This repository at `rev` in a temporary worktree, its module built there; the module's path."""
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            print(f"building {rev} in {tree} (minutes the first time) ...", flush=True)
            show = "from kernels import native; print(native.extension().__file__)"
            out = subprocess.run([sys.executable, "-c", show], cwd=tree, check=True, capture_output=True, text=True)
            return Path(out.stdout.strip().splitlines()[-1])  # the module stays where torch builds it
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)


def load(path: Path):
    if path.is_dir():
        path = next(path.glob("*.so"))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a loadable module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def largest_difference(a, b) -> float:
    """Over the outputs two calls returned (0 for none: a kernel that writes into an argument,
    such as heads_bf16, is timed but not compared)."""
    a, b = (a if isinstance(a, (tuple, list)) else (a,)), (b if isinstance(b, (tuple, list)) else (b,))
    return max((x.float() - y.float()).abs().max().item() if x is not None and x.numel() else 0.0
               for x, y in zip(a, b))


def compare(name: str, case: Case, old, new, repeats: int) -> dict:
    make, call, in_place = case
    args = make(torch.Generator().manual_seed(0))
    mine = {"old": list(args), "new": list(args)}
    for i in in_place:  # each module advances its own copy of the states
        mine["old"][i] = args[i].clone()
        mine["new"][i] = args[i].clone()
    try:
        outs = {side: call(ext, *mine[side]) for side, ext in (("old", old), ("new", new))}
    except (AttributeError, TypeError, RuntimeError) as e:
        return {"case": name, "skipped": str(e).splitlines()[0][:100]}
    diff = largest_difference(outs["old"], outs["new"])
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(repeats):
        for side, ext in (("old", old), ("new", new)):
            t0 = time.perf_counter()
            call(ext, *mine[side])
            best[side] = min(best[side], time.perf_counter() - t0)
    return {"case": name, "old_us": best["old"] * 1e6, "new_us": best["new"] * 1e6,
            "ratio": best["new"] / best["old"], "max_diff": diff}


# kernels the engine calls that advance states in place: (index of the states argument, index of
# the slots argument, or None where the whole tensor is restored: the chunk kernels write their
# sequences' and checkpoints' rows of it, as does the conv prefill)
IN_PLACE = {"delta_step": (5, 6), "conv_step": (3, 4), "ssd_step": (6, 7), "chunk_delta_rule_slots": (5, None),
            "chunk_ssd_slots": (6, None), "causal_conv1d_slots": (3, None)}
# kernels that write their output into a tensor the engine gives (the round's output rows): the
# index of that argument. Each module is given an empty one instead and makes its own output (the
# engine copies the new module's in); a module built before the argument existed is called without it.
OUT_ARG = {"chunk_delta_rule_slots": 13, "chunk_ssd_slots": 13, "causal_conv1d_slots": 10}


class Both:
    """The new module, except that each call of `kernels` also runs on the old one, timed from each
    kernel's second call on (its first pays the page faults of its first large output: ~20 ms at
    12,672 x 256 fp32 on either module, which swamped a small kernel's total). Where a kernel
    advances states in place, the second call starts from the states the first one was given, and
    the engine carries on with the new module's states."""

    def __init__(self, old, new, kernels: list[str]):
        self.old, self.new, self.kernels = old, new, kernels
        self.flip = dict.fromkeys(kernels, False)  # per kernel: one shared flip can give a kernel one order
        self.rows = {k: {"case": k, "calls": 0, "old_s": 0.0, "new_s": 0.0, "max_diff": 0.0} for k in kernels}
        self.takes_out: dict[tuple[str, str], bool] = {}  # (side, kernel): whether it has the out argument

    def __getattr__(self, name):
        if name not in self.kernels:
            return getattr(self.new, name)
        row = self.rows[name]

        def run(side: str, ext, args: tuple):
            if name not in OUT_ARG or len(args) <= OUT_ARG[name]:
                return getattr(ext, name)(*args)
            at = OUT_ARG[name]
            if self.takes_out.setdefault((side, name), True):
                try:  # the arguments after it (chunk_ssd_slots' gated norm) as the engine gave them
                    return getattr(ext, name)(*args[:at], EMPTY, *args[at + 1 :])
                except TypeError:  # built before the argument: only its first call gets here (untimed)
                    self.takes_out[side, name] = False
            return getattr(ext, name)(*args[:at])

        def call(*args):
            self.flip[name] = not self.flip[name]  # which module goes first (the second finds warm caches)
            sides = [("new", self.new), ("old", self.old)]
            state, slots = IN_PLACE.get(name, (None, None))
            rows = slice(None) if slots is None else args[slots]
            before = None if state is None else args[state][rows].clone()
            outs, after, timed = {}, {}, row["calls"] > 0
            for side, ext in sides if self.flip[name] else sides[::-1]:
                if before is not None and outs:  # the second call: from the states the first was given
                    args[state][rows] = before
                t0 = time.perf_counter()
                outs[side] = run(side, ext, args)
                row[f"{side}_s"] += time.perf_counter() - t0 if timed else 0.0
                if before is not None:
                    after[side] = args[state][rows].clone()
            if before is not None:
                args[state][rows] = after["new"]
            row["calls"] += 1
            row["max_diff"] = max(row["max_diff"], largest_difference(outs["old"], outs["new"]))
            return outs["new"]
        return call


def peer_engine(model: str, cache: Path, requests: int, prefix: int, suffix: int, tokens: int):
    """An LLM on the model's peer checkpoint (dtype and prefix caching as in its first peer row),
    warmed up on a short prompt, and the peer workload for it."""
    from benchmarks import peers
    from hybridserve import LLM, SamplingParams

    row = next(r for r in peers.ROWS.values() if r.model == model)
    work = peers.workload(argparse.Namespace(requests=requests, prefix=prefix, suffix=suffix, new=tokens), row.vocab)
    llm = LLM(str(peers.checkpoint(model, cache)[0]), dtype=row.dtype, enable_prefix_cache=row.prefix_cache,
              max_running=requests, memory_gb=peers.MEMORY_GB)
    llm.generate([work["warmup"]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    return llm, work


def engine_calls(model: str, old, new, kernels: list[str], cache: Path, requests: int, prefix: int, suffix: int,
                 tokens: int) -> list[dict]:
    """The peer workload once through the engine (dtype and prefix caching as in the model's first
    peer row; the layers' one-call decode bodies off, so that decode calls its kernels one by one),
    the calls of `kernels` made on both modules; per kernel: calls, summed seconds per module, their
    ratio and the largest output difference."""
    import models.batch
    from hybridserve import SamplingParams

    both = Both(old, new, kernels)
    real, native.extension = native.extension, lambda: both  # type: ignore[assignment]
    fused, models.batch.FUSED_DECODE = models.batch.FUSED_DECODE, False
    try:
        llm, work = peer_engine(model, cache, requests, prefix, suffix, tokens)
        for r in both.rows.values():
            r.update(calls=0, old_s=0.0, new_s=0.0, max_diff=0.0)  # the measured calls only
        llm.generate(work["prompts"], SamplingParams(temperature=0, max_tokens=work["new"], ignore_eos=True))
    finally:
        native.extension = real  # type: ignore[assignment]
        models.batch.FUSED_DECODE = fused
    return [dict(r, ratio=r["new_s"] / r["old_s"] if r["old_s"] else float("nan")) for r in both.rows.values()]


class Timed:
    """A module whose every kernel call adds its seconds to times[name] (a step's kernels, per module)."""

    def __init__(self, module, times: dict[str, float]):
        self.module, self.times = module, times

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            return out
        return call


def engine_steps(model: str, old, new, cache: Path, requests: int, prefix: int, suffix: int, steps: int) -> dict:
    """The peer workload's prompts prefilled through the engine on the new module, then `steps`
    decode steps (the layers' one-call decode bodies on, as a real run makes them) alternating the
    module from step to step in ABBA order (each module as often first after the other). Returns
    per module the steps' seconds ("steps") and each kernel's summed seconds ("kernels"). A decode
    step reads the KV pages and recurrent states of every sequence, more than the caches hold, so a
    kernel bound by memory latency is timed on the caches the rest of the step left; `Both` calls
    each kernel twice in a row, and the second call finds the first one's rows in cache."""
    from hybridserve import SamplingParams
    from scheduler.request import Status

    missing = sorted(n for n in dir(new) if not n.startswith("_") and callable(getattr(new, n)) and
                     not hasattr(old, n))
    if missing:  # the engine's wrappers would call them on the old module
        raise SystemExit(f"--steps: the old module lacks {', '.join(missing)}: compare builds with the same kernels")
    result: dict = {"steps": {"old": [], "new": []}, "kernels": {"old": {}, "new": {}}}
    timed = {"old": Timed(old, result["kernels"]["old"]), "new": Timed(new, result["kernels"]["new"])}
    current = {"module": new}
    real, native.extension = native.extension, lambda: current["module"]  # type: ignore[assignment]
    try:
        llm, work = peer_engine(model, cache, requests, prefix, suffix, steps)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for prompt in work["prompts"]:
            engine.add_request(prompt, params, outputs="final")
        while any(entry[0].status is not Status.DECODE for entry in engine.requests.values()):
            engine.step()  # every prompt prefilled: from here each step decodes all of them
        for i in range(steps):
            side = "old" if (i + i // 2) % 2 else "new"  # new, old, old, new, new, old, ...
            current["module"] = timed[side]
            t0 = time.perf_counter()
            engine.step()
            result["steps"][side].append(time.perf_counter() - t0)
    finally:
        native.extension = real  # type: ignore[assignment]
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--rev", help="a git revision of this repository: its kernels are built and compared")
    which.add_argument("--old", type=Path, help="a module built before (its .so or its build folder)")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated substrings of the case names to run")
    ap.add_argument("--engine", help="run the peer workload through the engine on this model instead of the cases")
    ap.add_argument("--kernels", default="paged_prefill,paged_decode", help="--engine: the kernels to compare")
    ap.add_argument("--steps", type=int, default=0,
                    help="--engine: time this many whole decode steps instead, the module alternating by step")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hybridserve-peers",
                    help="--engine: where the peer checkpoints are built")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    if args.steps and (not args.engine or args.steps < 2):
        ap.error("--steps: with --engine, and at least 2 (one a module)")
    new = native.extension()
    if new is None:
        raise SystemExit("this checkout's CPU kernels are not built (see the log above)")
    old = load(build_rev(args.rev) if args.rev else args.old)
    keep_freed_memory()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return compare_modules(args, ap, old, new)
    finally:
        torch.set_num_threads(threads)  # as found: main() also runs inside other processes (the tests)


def step_rows(args: argparse.Namespace, old, new) -> dict:
    """--engine with --steps: both modules' decode steps and the kernels in them, printed and
    returned as one row (kernel times per step)."""
    print(f"old {Path(old.__file__).parent.name}, new {Path(new.__file__).parent.name}; {args.engine}, "
          f"{args.requests} requests of {args.prefix} shared + {args.suffix} own tokens, then {args.steps} decode "
          f"steps alternating; {args.threads} threads")
    res = engine_steps(args.engine, old, new, args.cache, args.requests, args.prefix, args.suffix, args.steps)
    times, kernels = res["steps"], res["kernels"]
    row: dict = {"case": "decode step", "steps": {side: len(t) for side, t in times.items()}, "kernels": {}}
    for side, t in times.items():
        row[f"{side}_mean_s"], row[f"{side}_median_s"] = statistics.mean(t), statistics.median(t)
    row["ratio"] = row["new_median_s"] / row["old_median_s"]
    print(f"decode step  old: mean {row['old_mean_s'] * 1e3:.2f} ms, median {row['old_median_s'] * 1e3:.2f} ms  "
          f"new: mean {row['new_mean_s'] * 1e3:.2f} ms, median {row['new_median_s'] * 1e3:.2f} ms  "
          f"new/old (medians) {row['ratio']:.3f}", flush=True)
    for name in sorted(kernels["new"], key=lambda k: -kernels["new"][k]):
        o, n = (kernels[side].get(name, 0.0) / len(times[side]) for side in ("old", "new"))
        row["kernels"][name] = {"old_s": o, "new_s": n, "ratio": n / o if o else float("nan")}
        print(f"  {name:20s} old {o * 1e3:7.3f} ms  new {n * 1e3:7.3f} ms a step  "
              f"new/old {row['kernels'][name]['ratio']:5.2f}")
    return row


def compare_modules(args: argparse.Namespace, ap: argparse.ArgumentParser, old, new) -> list[dict]:
    """The engine's calls (--engine) or the cases, on both modules; the rows printed as they come."""
    if args.engine:
        from benchmarks import peers

        models = sorted({r.model for r in peers.ROWS.values()})
        if args.engine not in models:
            ap.error(f"--engine {args.engine}: one of {', '.join(models)}")
        if args.steps:
            return [step_rows(args, old, new)]
        kernels = [k for k in args.kernels.split(",") if k]
        missing = [k for k in kernels if not (callable(getattr(old, k, None)) and callable(getattr(new, k, None)))]
        if not kernels or missing:
            ap.error(f"--kernels: {', '.join(missing) or 'none given'}: not a kernel of both modules")
        print(f"old {Path(old.__file__).parent.name}, new {Path(new.__file__).parent.name}; {args.engine}, "
              f"{args.requests} requests of {args.prefix} shared + {args.suffix} own tokens, {args.new} new; "
              f"{args.threads} threads")
        rows = engine_calls(args.engine, old, new, kernels, args.cache, args.requests, args.prefix, args.suffix,
                            args.new)
        for r in rows:
            print(f"{r['case']:16s} {r['calls']:5d} calls  old {r['old_s']:7.3f} s  new {r['new_s']:7.3f} s  "
                  f"new/old {r['ratio']:5.2f}  max diff {r['max_diff']:.1e}", flush=True)
        return rows
    wanted = [w for w in args.only.split(",") if w]
    rows = []
    print(f"old {Path(old.__file__).parent.name}, new {Path(new.__file__).parent.name}; "
          f"min of {args.repeats} alternating calls, {args.threads} threads")
    for name, case in CASES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        r = compare(name, case, old, new, args.repeats)
        rows.append(r)
        if "skipped" in r:
            print(f"{name:28s} skipped: {r['skipped']}")
        else:
            print(f"{name:28s} old {r['old_us']:9.1f} us  new {r['new_us']:9.1f} us  new/old {r['ratio']:5.2f}  "
                  f"max diff {r['max_diff']:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    main()
