"""EngineConfig: everything an engine is built from, validated once.

Settings live in three frozen dataclasses, each the one home of its fields' defaults,
checks and help text: `EngineConfig` (model, device, memory), `SchedulerConfig`
(scheduler/config.py) and `CacheConfig` (state_cache/config.py). Setting names are unique
across the three, so callers use one flat namespace: `EngineConfig.from_settings(
policy="tokens", memory_gb=2)`, `config.replace(...)`, `LLM(model, **settings)` and the CLI
flags (generated from the fields: memory_gb -> --memory-gb).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from scheduler import SchedulerConfig
from state_cache import CacheConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
STATE_DTYPES = ("auto", "float32", "bfloat16")
# Offline rounds' predicted seconds (max_step, and target_step with it) unless given. Per prompt
# token a round costs less the larger it is (each round reads every weight once, runs every layer's
# kernels once, and carries the decode rows of finished prompts); on the 2-core CPU host of
# docs/benchmarks.md the offline rows ran 5-9% faster in 1 s rounds than in 0.5 s ones and no
# faster in 2 s ones. The server keeps SchedulerConfig's max_step: there it bounds decode gaps.
OFFLINE_STEP = 1.0
# Offline rounds' most tokens (max_round_tokens) unless given: seconds alone would let a fast GPU
# put a whole batch of prompts in one round, its activations unbudgeted. Well above the CPU hosts'
# 1 s rounds (16-20K tokens); the server keeps no cap (a late prompt's deadline may need more).
OFFLINE_ROUND_TOKENS = 65536
SECTIONS: dict[str, type] = {"scheduler": SchedulerConfig, "cache": CacheConfig}


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="builtin", metadata={
        "help": "checkpoint folder in the Hugging Face layout (config.json + safetensors + tokenizer), or "
                "'builtin' for the small Kimi-Linear model shipped with the package (byte tokenizer, trained on Python "
                "sources)"})
    device: str = field(default="cpu", metadata={"help": "torch device to run on, e.g. cpu or cuda:0"})
    dtype: str = field(default="auto", metadata={
        "help": "weight, activation and KV dtype; auto keeps the checkpoint's (recurrent states: see state_dtype)",
        "choices": DTYPES})
    state_dtype: str = field(default="auto", metadata={
        "help": "dtype the recurrent states (and their checkpoints) are kept in; auto: the model's (fp32, or what a "
                "NemotronH checkpoint's mamba_ssm_cache_dtype says); bfloat16 halves the state bytes of every decode "
                "step and checkpoint, the CPU kernels rounding the state after each 64-token chunk and each token",
        "choices": STATE_DTYPES})
    page_size: int = field(default=64, metadata={"help": "tokens per attention-KV page"})
    memory_gb: float = field(default=1.0, metadata={
        "help": "GiB for the KV pages, the active state slots and the checkpoints together"})
    checkpoint_share: float | None = field(default=None, metadata={
        "help": "static split: this share of the memory left after the active slots is recurrent-state checkpoint "
                "slots, the rest KV pages; unset: one budget, KV pages and checkpoints carved from the same pages on "
                "demand and evicted in one order"})
    staging_rows: int = field(default=8, metadata={
        "help": "under the one budget: state rows a forward writes new prefill checkpoints into before the cache "
                "stores them in pages (at most this many per round; capped at max_running)"})
    host_memory_gb: float = field(default=0.0, metadata={
        "help": "GiB of host memory (pinned on a GPU) for a second tier: KV pages and checkpoints evicted from the "
                "device move there and are copied back on a hit when that is cheaper than recomputing; 0: none "
                "(needs the one budget)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt + output in tokens; unset: the model's context"})
    cost_profile: str | None = field(default=None, metadata={
        "help": "step-time model of the serial policies: a shipped profile name or a JSON file from `hybridserve "
                "calibrate`; unset: the shipped builtin_cpu (fp32) or builtin_cpu_bf16 profile for the built-in model "
                "on CPU, else one fitted at start-up from a few timed forwards (only when the policy reads it)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "processes (one per GPU on CUDA) the model's heads and channels are split across, joined by "
                "torch.distributed (NCCL on CUDA, gloo on CPU); memory_gb is per rank"})
    context_parallel_size: int = field(default=1, metadata={
        "help": "processes (one per GPU on CUDA) a long prefill is split across by tokens (each holds the whole "
                "model and a replica of the pools; the rest of a round runs on all of them); memory_gb is per rank"})
    seed: int = field(default=0, metadata={"help": "seed for torch (sampling of requests without their own seed)"})
    adaptive_threads: bool = field(default=True, metadata={
        "help": "on CPU, run each round on the CPUs other processes leave free (from /proc/stat; at most torch's "
                "thread count at the first round), so threads do not wait on descheduled partners on a busy machine; "
                "matmuls may round differently at another thread count, so turn it off for bitwise-repeatable runs"})
    warmup: bool = field(default=True, metadata={
        "help": "at start-up, run one forward as large as the largest round the scheduler can plan (on free pages "
                "and slots; nothing kept), so that the memory its activations take is mapped before the first "
                "requests rather than page-faulted in during them (single-rank engines)"})
    debug_integrity: bool = field(default=False, metadata={
        "help": "check every pool's integrity whenever the engine is idle (slow; for debugging)"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {list(DTYPES)}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: {self.state_dtype!r} is not one of {list(STATE_DTYPES)}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")
        if self.checkpoint_share is not None and not 0 <= self.checkpoint_share < 1:
            raise ValueError(f"checkpoint_share must be in [0, 1) or unset, got {self.checkpoint_share}")
        if self.staging_rows < 1:
            raise ValueError(f"staging_rows must be >= 1, got {self.staging_rows}")
        if self.host_memory_gb < 0:
            raise ValueError(f"host_memory_gb must be >= 0, got {self.host_memory_gb}")
        if self.host_memory_gb and self.checkpoint_share is not None:
            raise ValueError("host_memory_gb: a host tier needs the one budget (leave checkpoint_share unset)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {self.context_parallel_size}")
        if self.tensor_parallel_size > 1 and self.context_parallel_size > 1:
            raise ValueError("context_parallel_size: tensor and context parallelism together are not supported")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name}: must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")

    @classmethod
    def settings(cls) -> dict[str, tuple[str | None, dataclasses.Field]]:
        """Every setting by flat name: (its section, or None for EngineConfig's own, the field)."""
        out: dict[str, tuple[str | None, dataclasses.Field]] = {}
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS:
                out.update((g.name, (f.name, g)) for g in dataclasses.fields(SECTIONS[f.name]))
            else:
                out[f.name] = (None, f)
        return out

    @classmethod
    def from_settings(cls, **settings: Any) -> EngineConfig:
        """A config from flat setting names (the defaults for the rest)."""
        return cls().replace(**settings)

    @classmethod
    def offline(cls, **settings: Any) -> EngineConfig:
        """from_settings for offline generation (`LLM`, `hybridserve generate`): nobody reads a
        token before its whole output, so the serial policies' rounds fill up to `max_step`
        (OFFLINE_STEP unless given) rather than the server's `target_step` (an inter-token
        latency target), unless `target_step` (or a `scheduler` section) is given; and hold at
        most OFFLINE_ROUND_TOKENS tokens unless `max_round_tokens` is given."""
        if "scheduler" not in settings:
            settings.setdefault("max_step", OFFLINE_STEP)
            settings.setdefault("target_step", settings["max_step"])
            settings.setdefault("max_round_tokens", OFFLINE_ROUND_TOKENS)
        return cls.from_settings(**settings)

    def replace(self, **settings: Any) -> EngineConfig:
        """A copy with flat-named settings changed; TypeError names an unknown setting."""
        known = self.settings()
        for name in settings:
            if name not in known and name not in SECTIONS:
                close = difflib.get_close_matches(name, list(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise TypeError(f"unknown engine setting {name!r}{hint}")
        own = {k: v for k, v in settings.items() if k in SECTIONS or known[k][0] is None}
        for section in SECTIONS:
            changes = {k: v for k, v in settings.items() if k in known and known[k][0] == section}
            if changes:
                own[section] = dataclasses.replace(own.get(section, getattr(self, section)), **changes)
        return dataclasses.replace(self, **own)

    def flat(self) -> dict[str, Any]:
        """Every setting by flat name, with its value (the inverse of from_settings)."""
        return {name: getattr(getattr(self, sec) if sec else self, name) for name, (sec, _) in self.settings().items()}
