"""SchedulerConfig: the scheduling policy and its knobs, one default and one check each."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.policy import LinearSlo, policy_names


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = field(default="serial+deadline", metadata={
        "help": "scheduling policy: tokens (fixed token budget, one chunked prompt at a time, prefill first), "
                "budget (one token budget shared with decode, decode first), serial (fill each round up to "
                "--target-step predicted seconds), serial+deadline (serial, earliest TTFT deadline first; a late "
                "prompt's chunk grows up to --max-step)",
        "choices": policy_names})
    max_running: int = field(default=32, metadata={
        "help": "most requests admitted at once (one active state slot each)"})
    token_budget: int = field(default=2048, metadata={
        "help": "tokens per round under the tokens and budget policies"})
    target_step: float = field(default=0.1, metadata={
        "help": "seconds of predicted step time per round under the serial policies (from the ITL target)"})
    max_step: float = field(default=0.5, metadata={
        "help": "cap on a round's predicted seconds when serial+deadline grows a late prompt's chunk"})
    max_round_tokens: int | None = field(default=None, metadata={
        "help": "serial policies: most tokens a round holds, its decode rows plus the prefill chunks beside them "
                "(decode rows always run, and the first chunk advances at least one checkpoint step), which "
                "bounds a round's activation memory where the predicted time alone would let a fast device take "
                "very many tokens; unset: no cap (what a deadline may need)"})
    mixed_chunk: bool = field(default=False, metadata={
        "help": "tokens policy: let decode rows ride along with the prefill chunk"})
    decode_steps_between_prefills: int = field(default=0, metadata={
        "help": "tokens policy: decode-only rounds after each prefill round"})
    aligned_cuts: bool = field(default=True, metadata={
        "help": "end every middle prefill chunk on the checkpoint grid G (off: where the budget ends; the "
                "chunks after an off-grid cut can write no checkpoint, a comparison setting for studies)"})
    decode_reserve: float = field(default=1.0, metadata={
        "help": "share of each request's max_tokens whose KV pages admission reserves (1: admit only what "
                "surely fits; lower admits more and retracts when the pool runs short)"})
    skip_ahead_wait: float = field(default=30.0, metadata={
        "help": "seconds a waiting request that does not fit the KV pool may be passed by later ones that do; "
                "after that, admission holds for it until it fits (0: strict queue order)"})
    queue_timeout: float | None = field(default=None, metadata={
        "help": "seconds a request may wait for admission (since it was queued, or retracted) before it ends "
                "with finish_reason queue_timeout; unset: it waits until served"})
    ttft_slo_base: float = field(default=2.0, metadata={
        "help": "TTFT deadline of a request: ttft_slo_base + ttft_slo_per_token * prompt tokens seconds"})
    ttft_slo_per_token: float = field(default=2e-4, metadata={
        "help": "seconds per prompt token added to the TTFT deadline"})

    def __post_init__(self):
        if self.policy not in policy_names():
            raise ValueError(f"policy: unknown scheduling policy {self.policy!r}; known: {policy_names()}")
        if self.max_round_tokens is not None and self.max_round_tokens < 1:
            raise ValueError(f"max_round_tokens must be >= 1 (or unset), got {self.max_round_tokens}")
        for name in ("max_running", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.target_step <= self.max_step:
            raise ValueError(f"target_step must be in (0, max_step={self.max_step}], got {self.target_step}")
        if self.decode_steps_between_prefills < 0:
            raise ValueError(f"decode_steps_between_prefills must be >= 0, got {self.decode_steps_between_prefills}")
        if not 0 < self.decode_reserve <= 1:
            raise ValueError(f"decode_reserve must be in (0, 1], got {self.decode_reserve}")
        if self.queue_timeout is not None and self.queue_timeout <= 0:
            raise ValueError(f"queue_timeout must be > 0 (or unset), got {self.queue_timeout}")
        for name in ("skip_ahead_wait", "ttft_slo_base", "ttft_slo_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def ttft_slo(self) -> LinearSlo:
        return LinearSlo(self.ttft_slo_base, self.ttft_slo_per_token)
