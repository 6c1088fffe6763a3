"""What the scheduler hands the executor, and what it gets back."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.cost import BatchShape
from scheduler.request import Req


class Chunk(NamedTuple):
    """Prefill tokens [start, end) of req's fill ids; checkpoints: (position, slot) to write."""

    req: Req
    start: int
    end: int
    checkpoints: tuple[tuple[int, int], ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk ends the fill: its last logits give the request's next token."""
        return self.end == self.req.fill_len


@dataclass
class Batch:
    """One round: prefill chunks first, then decode rows (one token at req.prefix_len each)."""

    chunks: list[Chunk]
    decodes: list[Req]
    shape: BatchShape
    predicted: float  # seconds, from the cost model
    copy_s: float = 0.0  # seconds of host-tier copies made while scheduling it (cost model's host link)
    sampling_reqs: list[Req] = field(init=False)  # rows whose next token the executor returns, in order

    def __post_init__(self):
        self.sampling_reqs = [c.req for c in self.chunks if c.samples] + list(self.decodes)

    @property
    def num_tokens(self) -> int:
        return self.shape.tokens


class StepOutput(NamedTuple):
    """The executor's answer: one token per `batch.sampling_reqs` entry (plus extras the
    engine attaches, e.g. logprobs), and the seconds the forward took."""

    tokens: list[int]
    elapsed: float = 0.0
    extras: list | None = None


class Executor(ABC):
    """Runs a scheduled round: the model runner (real forwards) and the `sim` executor (the
    cost model advances a clock) both implement this, so the scheduler drives either."""

    @abstractmethod
    def run(self, batch: Batch) -> StepOutput:
        """One token per `batch.sampling_reqs` row, and the seconds the round took."""
