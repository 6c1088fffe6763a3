"""Engine: the step loop (schedule -> run -> process) over one model, its pools and cache."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

import torch

from hybridserve.calibrate import warm_up
from hybridserve.config import EngineConfig
from hybridserve.engine_info import EngineInfo, Prompt
from hybridserve.host import ThreadGovernor, keep_freed_memory
from hybridserve.outputs import OUTPUTS, Detokenizer, RequestOutput, ids_decoder
from hybridserve.parallel import ParallelRunner, Workers
from hybridserve.runner import ModelRunner
from hybridserve.sampling import Sampler, SamplingParams
from kernels import native
from models.batch import Memory
from models.builtin import ByteTokenizer, builtin_path
from models.layers.tensor_parallel import TensorParallel
from models.loader import load_model
from scheduler import BatchShape, CostModel, Drift, Executor, Req, Scheduler, policy_class
from state_cache import Journal, PrefillFlops, StateRadixCache, make_host_pool, make_pools, plan_memory

log = logging.getLogger(__name__)
# the shipped step-time profiles of the built-in model on CPU, by dtype (scheduler/profiles/)
BUILTIN_CPU = {torch.float32: "builtin_cpu", torch.bfloat16: "builtin_cpu_bf16"}
# rounds off their cost profile's predictions by more than this factor get a warning. Healthy
# profiles ran at 0.63-0.82x of their predictions on a batch sharing a 1,024-token prefix (shared
# pages are read once, which the profile does not price); the stale one that prompted it at 0.04-0.17x
DRIFT_LIMIT = 3.0


class NoTokenizer:
    """For checkpoint folders without tokenizer files: prompts must be token ids; no text out."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        raise ValueError("prompt: this model has no tokenizer; send token ids")

    def decode(self, ids) -> str:
        return ""

    def apply_chat_template(self, messages, **kwargs):
        raise ValueError("messages: this model has no tokenizer (and no chat template)")


def load_tokenizer(model: str, path: Path):
    if model == "builtin":
        return ByteTokenizer()
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return NoTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def model_path(config: EngineConfig) -> Path:
    return builtin_path() if config.model == "builtin" else Path(config.model)


def load_engine_model(config: EngineConfig, device: str, tp: TensorParallel | None = None):
    """(model, ModelConfig) of the config's checkpoint in its dtype and state dtype ("auto": the
    checkpoint's own), this rank's shard under `tp`."""
    def pick(name: str) -> torch.dtype | None:
        return None if name == "auto" else getattr(torch, name)

    return load_model(model_path(config), device, pick(config.dtype), tp=tp, state_dtype=pick(config.state_dtype))


def build_memory(config: EngineConfig, mc, device: str):
    """(memory plan, KV pool, state pool, host pool or None) for a model config: the same on
    every tensor-parallel rank, each holding its shard's shapes."""
    plan = plan_memory(mc.kv_shapes, mc.state_shapes, budget_bytes=int(config.memory_gb * 2**30),
                       page_size=config.page_size, max_running=config.scheduler.max_running,
                       checkpoint_share=config.checkpoint_share, staging_rows=config.staging_rows,
                       host_bytes=int(config.host_memory_gb * 2**30), kv_dtype=mc.dtype)
    kv_pool, state_pool = make_pools(plan, mc.kv_shapes, mc.state_shapes, mc.dtype, device)
    return plan, kv_pool, state_pool, make_host_pool(plan, mc.kv_shapes, mc.dtype, device)


class Engine:
    """The serving loop over one model: `Engine(config, **settings)` (flat setting names, see
    EngineConfig), then add_request / step / abort."""

    def __init__(self, config: EngineConfig | None = None, **settings):
        config = (config or EngineConfig()).replace(**settings)
        self.config = config
        if torch.device(config.device).type == "cpu":
            keep_freed_memory()
            native.extension()  # built once per source version (a few minutes), not in the first decode step
        torch.manual_seed(config.seed)
        self.path = model_path(config)
        world = config.tensor_parallel_size * config.context_parallel_size
        self.workers = Workers(config, world) if world > 1 else None  # ranks 1..N-1 (hybridserve/parallel.py)
        try:
            self._build(config, world)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, world: int) -> None:
        if self.workers:
            torch.set_num_threads(max(1, torch.get_num_threads() // world))
        tp = config.tensor_parallel_size
        self.model, self.model_config = load_engine_model(config, config.device,
                                                          TensorParallel.of() if tp > 1 else None)
        self.model_name = config.model if config.model == "builtin" else self.path.name
        self.tokenizer = load_tokenizer(config.model, self.path)
        self.decode_ids = ids_decoder(self.tokenizer)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position, mc.max_position)
        self.plan, kv_pool, state_pool, host = build_memory(config, mc, config.device)
        self.memory = Memory(kv_pool.buffers, state_pool.buffers, config.page_size)
        params = sum(p.numel() for p in self.model.parameters()) * tp  # (embedding and lm_head counted N times)
        self.cache = StateRadixCache(kv_pool, state_pool, mc.kernel_chunks, config.cache,
                                     flops=PrefillFlops(2.0 * params), host=host)
        self.sampler = Sampler(config.device)
        if self.workers:
            journal = Journal({"kv": kv_pool, "state": state_pool, "host": host})
            self.executor: Executor = ParallelRunner(self.model, self.memory, config.device, self.sampler,
                                                     state_pool.row, self.workers, journal,
                                                     cp=config.context_parallel_size, align=self.cache.granularity)
        else:
            self.executor = ModelRunner(self.model, self.memory, config.device, self.sampler, state_pool.row)
        cost = self._with_host_link(self._cost_model()).context_parallel(config.context_parallel_size)
        self.scheduler = Scheduler(self.cache, config.scheduler, cost, time.monotonic)
        if config.warmup and not self.workers:
            self.warm_up()
        self.info = EngineInfo(config, self.model_name, self.tokenizer, mc.vocab_size, self.max_model_len,
                               self.scheduler.kv_capacity_tokens)
        # rid -> (req, its text, OUTPUTS kind, its logprobs so far: SamplingParams.logprobs set)
        self.requests: dict[str, tuple[Req, Detokenizer, str, list]] = {}
        self._ids = itertools.count()
        self.threads: ThreadGovernor | None = None  # made at the first round, on the thread that steps
        self.cpu_partners: tuple[int, ...] = ()  # processes whose CPU time counts as ours (a server's front)
        self.drift: Drift | None = Drift()  # None once it has warned
        self.eos = set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None
                                            else set())
        ranks = f", {world} ranks (tensor x{tp}, context x{config.context_parallel_size}; per rank below)"
        log.info("model %s (%s, %s), policy %s%s\n%s", self.model_name, "/".join(mc.layer_kinds), mc.dtype,
                 config.scheduler.policy, ranks if self.workers else "", self.plan.report())

    def warm_up(self) -> BatchShape | None:
        """One forward of the largest round the policy can plan (policy.most_tokens()), before any
        request: the first rounds of a process otherwise fault in every page their activations
        take (on the 2-core VM of docs/benchmarks.md about 140K faults and 0.9 s in NemotronH's
        first 20K-token rounds). The shape that ran; None where the policy knows no bound."""
        tokens = self.scheduler.policy.most_tokens()
        if not tokens:
            return None
        t0 = time.perf_counter()
        shape = warm_up(self.model, self.memory, self.cache, tokens, self.max_model_len)
        log.info("warm-up: one forward of %d tokens in %d prompts, %.2f s", shape.tokens, len(shape.prefill),
                 time.perf_counter() - t0)
        return shape

    def _profile_name(self) -> str | None:
        """The profile the engine loads: the configured one, else for the built-in model on CPU
        the shipped one of its dtype; None: one is fitted at start-up (or none is needed)."""
        if self.config.cost_profile:
            return self.config.cost_profile
        if self.config.model == "builtin" and self.config.device == "cpu":
            return BUILTIN_CPU.get(self.model_config.dtype)
        return None

    def _cost_model(self) -> CostModel:
        """The configured profile; for the built-in model on CPU the shipped one of its dtype; else,
        if the policy reads it, one fitted now (otherwise an all-zero model: predictions unused)."""
        name = self._profile_name()
        if name:
            return CostModel.load(name)
        if not policy_class(self.config.scheduler.policy).uses_cost_model:
            return CostModel()
        if self.workers:
            raise ValueError("cost_profile: with several ranks give a profile (`hybridserve calibrate` fits one on a "
                             "single rank) or a policy that needs none (tokens, budget)")
        from hybridserve.calibrate import calibrate

        return calibrate(self.model, self.model_config, self.memory, self.cache, quick=True)
    def _with_host_link(self, cost: CostModel) -> CostModel:
        """With a host tier, a profile without the host link's speed gets it measured now (the
        scheduler prices loads with it)."""
        if self.cache.host is None or cost.host_bytes_per_s:
            return cost
        from hybridserve.calibrate import host_link

        link = host_link(self.memory)
        log.info("host tier: measured the host link at %.1f GB/s", link / 1e9)
        return dataclasses.replace(cost, host_bytes_per_s=link)

    # -- requests ------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, validated (EngineInfo.encode)."""
        return self.info.encode(prompt)

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids if the engine can serve it with params; else ValueError (EngineInfo.validate)."""
        return self.info.validate(prompt, params)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, rid: str | None = None,
                    outputs: str = "cumulative") -> str:
        """Queue a request; returns its id. ValueError for input the engine cannot serve.
        `outputs`: what step() returns for it (OUTPUTS); the last output is whole in every kind."""
        params = params or SamplingParams()
        ids = self.validate(prompt, params)
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs: {outputs!r} is not one of {', '.join(OUTPUTS)}")
        rid = rid or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"rid: {rid!r} is already in use")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        req = Req(rid, ids, params.max_tokens, sampling=params, stop_token_ids=frozenset(stops))
        self.scheduler.add(req)
        self.requests[rid] = (req, Detokenizer(self.tokenizer, params.stop, self.decode_ids), outputs, [])
        return rid

    def abort(self, rid: str) -> bool:
        """Stop a request and free what it holds; False if unknown or finished."""
        entry = self.requests.pop(rid, None)
        if entry is None:
            return False
        self.sampler.release(rid)
        return self.scheduler.abort(entry[0])

    def close(self) -> None:
        """Stop the workers of a multi-rank engine, if any (idempotent)."""
        if self.workers:
            self.workers.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One round: schedule -> run -> process; outputs of the requests that moved, and of
        those the scheduler ended while they waited (queue timeout)."""
        batch = self.scheduler.schedule()
        ended = [o for r in self.scheduler.pop_ended() if (o := self._output(r, None, new_token=False))]
        if batch is None:
            if self.config.debug_integrity and not self.scheduler.running:
                self.scheduler.check_integrity()
            return ended
        self._govern_threads()
        out = self.executor.run(batch)
        if self.threads is not None:
            self.threads.round_ended()
        self._check_drift(batch.predicted, out.elapsed)
        changed = self.scheduler.process(batch, out)
        extras = dict(zip(map(id, batch.sampling_reqs), out.extras or []))
        return ended + [o for r in changed if (o := self._output(r, extras.get(id(r))))]

    def _check_drift(self, predicted: float, elapsed: float) -> None:
        """Warn once when rounds take more than DRIFT_LIMIT times, or less than 1 / DRIFT_LIMIT of,
        what the cost profile predicts (median of recent rounds): a profile fitted before a
        kernel or machine change makes the serial policies size rounds wrongly."""
        if self.drift is None:
            return
        ratio = self.drift.observe(predicted, elapsed)
        if ratio is not None and not 1 / DRIFT_LIMIT <= ratio <= DRIFT_LIMIT:
            log.warning("cost profile %s: rounds take %.2fx its predictions (median of the last %d); the serial "
                        "policies size rounds from it: refit it with `hybridserve calibrate` (docs/scheduler.md)",
                        self._profile_name() or "fitted at start-up", ratio, len(self.drift.ratios))
            self.drift = None

    def _govern_threads(self) -> None:
        if not self.config.adaptive_threads or torch.device(self.config.device).type != "cpu":
            return
        if self.threads is None:
            self.threads = ThreadGovernor(torch.get_num_threads(), torch.set_num_threads, partners=self.cpu_partners)
        self.threads.update()

    def _output(self, req: Req, logprob, new_token: bool = True) -> RequestOutput | None:
        """req's output after this step (new_token: whether the step appended one); None where
        its kind returns nothing yet. A "final" request without stop strings is decoded once, at
        the end."""
        _, detok, kind, scored = self.requests[req.rid]
        if logprob:
            scored.append(logprob)
        if kind == "final" and not req.finished and not detok.stop:
            return None
        new_text = detok.update(req.output_ids, final=req.finished)
        if detok.stopped and not req.finished:
            self.scheduler.finish(req, "stop")
        if req.finished:
            self.requests.pop(req.rid, None)
            self.sampler.release(req.rid)
        elif kind == "final":
            return None
        new_ids = req.output_ids[-1:] if new_token else []
        whole = req.finished or kind == "cumulative"  # a delta leaves out what earlier steps returned
        return RequestOutput(req.rid, req.input_ids if whole else [], list(req.output_ids) if whole else [],
                             detok.text if whole else "", new_ids, new_text, req.finished, req.finish_reason,
                             req.cached_tokens, list(scored) if whole else [], [logprob] if logprob else [])

    def fail_inflight(self) -> list[str]:
        """After a step raised: abort the requests of the rounds in flight (the scheduler frees
        their pages, slots and checkpoint slots) and drop those rounds. Returns the failed ids;
        if no round was in flight the failure cannot be attributed and every request fails."""
        rids = [r.rid for r in self.scheduler.fail_inflight()] or list(self.requests)
        for rid in rids:
            self.abort(rid)
        return rids

    def audit(self) -> dict:
        """When idle: flush the cache, check every pool's integrity (IntegrityError names what
        is wrong) and count what is still held, which is a leak: every count must be 0.
        RuntimeError while requests are in the engine."""
        if self.scheduler.has_work():
            raise RuntimeError("requests are in the engine: audit only when idle")
        self.scheduler.flush_cache()
        self.scheduler.check_integrity()
        kv, st, host = self.cache.kv_pool, self.cache.state_pool, self.cache.host
        return {"kv_pages_held": kv.num_pages - kv.num_free,
                "active_slots_held": st.num_active - st.num_free_active,
                "checkpoint_slots_held": st.num_used_checkpoints,
                **({"host_pages_held": host.num_pages - host.num_free} if host else {})}

    def stats(self) -> dict:
        """Counters and pool usage for metrics."""
        s = self.scheduler
        out = {"waiting": len(s.waiting), "running": len(s.running), **s.counters,
               "split_rounds": getattr(self.executor, "split_rounds", 0), "cache": s.cache_stats()._asdict(),
               "resume_rates": self.cache.kind_rates.snapshot()}
        if self.threads is not None:
            out["threads"] = {"threads": self.threads.threads, "others_busy": self.threads.others}
        return out
