"""The `sim` executor: the cost model advances a clock, no tensor exists.

The scheduler and the cache run as in the engine (same objects), so a study at H200 /
48B scale replays a trace on this machine in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from scheduler import Batch, BatchShape, CostModel, Executor, Req, Scheduler, StepOutput


class SimClock:
    """An injectable clock: `clock()` reads it, the executor advances it."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimExecutor(Executor):
    """Runs a batch by advancing the clock by its predicted step time; samples `token`.

    replay_grid: price an engine that keeps a request's state only at multiples of this many
    tokens, so a chunk starting off that grid first recomputes from the multiple below its
    start; `replayed` records each recomputed range (req, from, to).
    """

    def __init__(self, cost: CostModel, clock: SimClock, token: int | Callable[[Req], int] = 0,
                 replay_grid: int | None = None):
        self.cost, self.clock, self.token, self.replay_grid = cost, clock, token, replay_grid
        self.replayed: list[tuple[Req, int, int]] = []

    def run(self, batch: Batch) -> StepOutput:
        shape = batch.shape
        if self.replay_grid:
            g = self.replay_grid
            starts = [c.start // g * g for c in batch.chunks]
            self.replayed += [(c.req, s, c.start) for c, s in zip(batch.chunks, starts) if s < c.start]
            shape = BatchShape([(s, c.end - s) for c, s in zip(batch.chunks, starts)], shape.decode)
        dt = self.cost.step_time(shape) + batch.copy_s  # host-tier copies made for it run before it
        self.clock.now += dt
        tok = self.token
        return StepOutput([tok(r) if callable(tok) else tok for r in batch.sampling_reqs], dt)


@dataclass
class SimRun:
    """What a simulation produced: every request, and one record per round."""

    requests: list[Req]
    rounds: list[tuple[float, float, int, int]] = field(default_factory=list)  # (start, seconds, tokens, decodes)


def simulate(scheduler: Scheduler, executor: SimExecutor, arrivals: Iterable[Req],
             until: float = float("inf"), on_round: Callable[[Scheduler], None] | None = None,
             stop: Callable[[], bool] | None = None) -> SimRun:
    """Feed requests at their `arrival` times (None: at the start) and step until all finish,
    the clock reaches `until`, or `stop()` says so."""
    clock = executor.clock
    pending = sorted(arrivals, key=lambda r: clock.now if r.arrival is None else r.arrival)
    times: list[float] = []  # arrival of pending[i]
    for r in pending:
        if r.arrival is None:
            r.arrival = clock.now
        times.append(r.arrival)
    run, i = SimRun(list(pending)), 0
    while clock.now < until and not (stop and stop()):
        while i < len(pending) and times[i] <= clock.now:
            scheduler.add(pending[i])
            i += 1
        batch = scheduler.schedule()
        if batch is None:
            if i == len(pending) and not scheduler.has_work():
                break
            if i < len(pending):
                clock.now = max(clock.now, times[i])  # idle until the next arrival
                continue
            raise RuntimeError("scheduler has work but scheduled nothing (deadlock)")
        start = clock.now
        out = executor.run(batch)
        run.rounds.append((start, out.elapsed, batch.num_tokens, len(batch.decodes)))
        scheduler.process(batch, out)
        if on_round:
            on_round(scheduler)
    return run
