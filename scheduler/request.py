"""Req: one request and its cursor through prefill and decode.

    input_ids + output_ids                  (fill target = len at admission)
    [0 ........ prefix_len ........ extend_end ........ fill_len)
     KV + state final   | scheduled, in flight | not yet scheduled

A round computes [prefix_len, extend_end); when its result is processed prefix_len moves
to that round's end. Rounds may be scheduled before the previous result returns (the
cursor extend_end runs ahead, `inflight_middle_chunks` counts the chunks in flight).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: Any = None  # opaque to the scheduler (the engine's SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float | None = None  # None: stamped with the scheduler's clock when added
    deadline: float | None = None  # None: arrival + the scheduler's TTFT SLO of the prompt
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    prefix_len: int = 0
    extend_end: int = 0
    fill_len: int = 0  # tokens to prefill before the next sample (prompt, or prompt + output after retraction)
    state_slot: int | None = None
    kv_pages: list[int] = field(default_factory=list)
    node: Any = None  # the cache node this request holds a lock on
    branch_pos: int = 0
    share_points: set[int] = field(default_factory=set)  # where requests waiting on this one part from it
    restore_from: Any = None  # the adopted checkpoint not yet copied into state_slot (copied when it next runs)
    rolling_ckpt: Any = None  # (pos, slot) of the latest decode checkpoint not yet in the tree
    transient_ckpts: list[int] = field(default_factory=list)  # chunk-end checkpoint positions to drop at finish
    inflight_middle_chunks: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache (state hit) at first admission
    kv_hit_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    retractions: int = 0
    seniority: int | None = None  # order of first admission, kept across retractions (victims are junior)
    queued_at: float = 0.0  # when it last entered the waiting queue (added or retracted)
    blocked_since: float | None = None  # since when admission has found it not fitting (None: not blocked)

    def __post_init__(self) -> None:
        self._ids = list(self.input_ids) + list(self.output_ids)
        self._tuple: tuple[int, ...] | None = None
        if not self.input_ids:
            raise ValueError("input_ids: a request needs at least one token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def all_ids(self) -> list[int]:
        """input_ids + output_ids (kept up to date by `append`; do not modify)."""
        return self._ids

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self._ids.append(token)
        self._tuple = None

    def token_ids(self, end: int) -> tuple[int, ...]:
        """all_ids[:end] as a tuple (what the cache keys on); the full tuple is built once."""
        if self._tuple is None:
            self._tuple = tuple(self._ids)
        return self._tuple if end == len(self._tuple) else self._tuple[:end]

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def remaining_fill(self) -> int:
        """Tokens still to be scheduled before the next sample."""
        return self.fill_len - self.extend_end

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def active_slot(self) -> int:
        """state_slot of a request that holds one (admitted, not yet released)."""
        if self.state_slot is None:
            raise RuntimeError(f"request {self.rid}: holds no active state slot (not admitted, or released)")
        return self.state_slot

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_new_tokens
