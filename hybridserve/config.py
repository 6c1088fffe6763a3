"""EngineConfig: everything an engine is built from, validated once."""
from __future__ import annotations

from dataclasses import dataclass, fields

from scheduler.policy import POLICIES
from state_cache import policy_names

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (CLI flags and `LLM(**kwargs)` map onto these fields one to one).

    model: a local checkpoint folder, or "builtin" for the built-in model.
    memory_gb: bytes for the KV pages, active slots and checkpoint slots together;
    checkpoint_share of what the active slots leave goes to checkpoints.
    policy: scheduling policy (tokens | budget | serial | serial+deadline) and its knobs;
    cost_profile: a shipped profile name or a JSON path for the serial policies (None: the
    shipped `builtin_cpu` for the built-in model on CPU, else a profile fitted at start-up
    from a few timed forwards of this model on this machine).
    """

    model: str = "builtin"
    device: str = "cpu"
    dtype: str = "auto"
    page_size: int = 64
    memory_gb: float = 1.0
    checkpoint_share: float = 0.2
    max_running: int = 32
    max_model_len: int | None = None
    policy: str = "serial"
    token_budget: int = 2048
    target_step: float = 0.2
    max_step: float = 1.0
    mixed_chunk: bool = False
    cost_profile: str | None = None
    enable_prefix_cache: bool = True
    eviction: str = "lru"
    checkpoint_interval: int | None = None
    decode_reserve: float = 1.0
    seed: int = 0
    debug_integrity: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {list(DTYPES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {list(POLICIES)}")
        if self.eviction not in policy_names():
            raise ValueError(f"eviction: {self.eviction!r} is not one of {policy_names()}")
        for name in ("page_size", "max_running", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_gb <= 0:
            raise ValueError(f"memory_gb must be > 0, got {self.memory_gb}")
        if not 0 <= self.checkpoint_share < 1:
            raise ValueError(f"checkpoint_share must be in [0, 1), got {self.checkpoint_share}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
