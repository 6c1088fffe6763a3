"""The checkpoint-hit replay against the real engine (`python -m benchmarks.checkpoint_hit --real`).

A small multi-turn trace runs through the engine on the built-in model (real forwards on this
machine), then through the replay (the same Scheduler and StateRadixCache classes, the same
memory plan and cache configuration, on the `sim` executor, emitting the tokens the engine
produced). Both are driven by the same step schedule (request i is added before step
`arrive[i]`), so the cache sees the same calls and every counter must agree exactly.
"""
from __future__ import annotations

import time

from benchmarks.traces import Tokens, parse
from benchmarks.traces.generate import chat
from hybridserve import Engine, SamplingParams
from hybridserve.sim import SimClock, SimExecutor
from scheduler import Req, Scheduler
from state_cache import StateRadixCache, make_host_pool, make_pools

COUNTERS = ("lookups", "lookup_tokens", "kv_hit_tokens", "state_hit_tokens", "inserted_checkpoints",
            "evicted_pages", "evicted_checkpoints", "host_hit_tokens", "bytes_to_host", "bytes_from_host")
# replayed policy -> its memory settings in the engine (the replay takes the engine's plan)
POLICIES = {"ours-unified": {}, "ours-unified+host": {"host_memory_gb": 0.05}, "ours-split": {"checkpoint_share": 0.5},
            "sglang-no-buffer": {"checkpoint_share": 0.9 / 1.9}, "sglang-extra-buffer": {"checkpoint_share": 0.9 / 1.9}}


def small_trace(conversations: int = 6):
    """A scaled-down chat trace (shorter texts) and the step before which each request arrives."""
    lines = sorted(chat(seed=1, conversations=conversations, rate=2.0), key=lambda d: d["timestamp"])
    for d in lines:  # shrink every run to a third, keep the structure (the same streams and offsets)
        d["prompt"] = [[s, o // 3, max(1, n // 3)] for s, o, n in d["prompt"]]
        d["output"] = [d["output"][0], d["output"][1] // 3, max(1, min(48, d["output"][2] // 3))]
    tokens = Tokens(vocab=256)
    reqs = [parse(d, tokens, i) for i, d in enumerate(lines)]
    return reqs, [2 * i for i in range(len(reqs))]


def run_engine(policy: str, reqs, arrive) -> tuple[dict, dict, Engine]:
    from benchmarks.replay import POLICIES as REPLAYED

    eng = Engine(model="builtin", dtype="float32", memory_gb=0.02, max_running=4, policy="serial",
                 cost_profile="builtin_cpu", **POLICIES[policy],
                 **_cache_settings(REPLAYED[policy.replace("+host", "+host256")].cache))
    outs, step = {}, 0
    while len(outs) < len(reqs):
        for i, t in enumerate(arrive):
            if t == step:
                eng.add_request(list(reqs[i].prompt), SamplingParams(temperature=0, max_tokens=len(reqs[i].output),
                                                                     ignore_eos=True), rid=f"r{i}")
        for o in eng.step():
            if o.finished:
                outs[o.rid] = tuple(o.token_ids)
        step += 1
    return eng.cache.stats()._asdict(), outs, eng


def run_replay(eng: Engine, reqs, arrive, outs) -> dict:
    plan, mc = eng.plan, eng.model_config
    clock = SimClock()
    kv, states = make_pools(plan, mc.kv_shapes, mc.state_shapes, mc.dtype)  # pools that only count
    cache = StateRadixCache(kv, states, mc.kernel_chunks, eng.config.cache, flops=eng.cache.flops,
                            host=make_host_pool(plan, mc.kv_shapes, mc.dtype))
    sched = Scheduler(cache, eng.config.scheduler, eng.scheduler.cost, clock)
    ex = SimExecutor(eng.scheduler.cost, clock, token=lambda r: outs[r.rid][len(r.output_ids)])
    runs = [Req(f"r{i}", list(r.prompt), len(r.output)) for i, r in enumerate(reqs)]
    step = 0
    while not all(r.finished for r in runs):
        for i, t in enumerate(arrive):
            if t == step:
                sched.add(runs[i])
        batch = sched.schedule()
        if batch is not None:
            sched.process(batch, ex.run(batch))
        step += 1
    return cache.stats()._asdict()


def _cache_settings(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def main(threads: int = 1) -> None:
    import torch

    torch.set_num_threads(threads)  # small forwards: more threads only contend on a shared machine
    reqs, arrive = small_trace()
    print(f"{len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, built-in model on this CPU "
          "(measured) against the replay (sim)")
    ok = True
    for policy in POLICIES:
        t0 = time.perf_counter()
        real, outs, eng = run_engine(policy, reqs, arrive)
        sim = run_replay(eng, reqs, arrive, outs)
        same = all(real[k] == sim[k] for k in COUNTERS)
        ok &= same
        print(f"{policy:20s} engine {time.perf_counter() - t0:5.1f} s  " + "  ".join(
            f"{k}={real[k]}" + ("" if real[k] == sim[k] else f" (replay {sim[k]})") for k in COUNTERS)
            + ("  == replay" if same else "  DIFFERS"))
    if not ok:
        raise SystemExit("the replay's counters differ from the engine's")
