"""The engine side of a served engine: commands in, events out, on the one thread that steps.

    commands (inbox)                      events (emit)
    ("add", rid, prompt, params)    ->    ("added", rid, error or None)
    ("abort", rid)                        (nothing: the front forgot the request already)
    ("call", n, fn)                 ->    ("result", n, fn(engine), error or None)
    None: stop                            ("step", outputs, failed rids, stats) after each step
                                          ("stats", stats) when it goes idle
                                          ("closed",) last, whatever ended the loop

The inbox is a queue of this process (QueueInbox; AsyncEngine: the engine on a thread) or a
pipe to the front's process (EngineProcess); `next(timeout)` raises queue.Empty when nothing
came (timeout None: wait, 0: do not). A step that raises fails only the requests of the batch it was running, a row
whose sampling raised fails only its request, and the loop goes on.
"""
from __future__ import annotations

import logging
import queue
from typing import Callable, Protocol

from hybridserve.engine import Engine

log = logging.getLogger("hybridserve.engine")
STALL_WAIT_S = 0.005


class Inbox(Protocol):
    def next(self, timeout: float | None) -> tuple | None: ...


class QueueInbox:
    """Commands from threads of this process."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, cmd: tuple | None) -> None:
        self.queue.put(cmd)

    def next(self, timeout: float | None) -> tuple | None:
        return self.queue.get(timeout=timeout)


def serve_engine(engine: Engine, inbox: Inbox, emit: Callable[[tuple], None]) -> None:
    """Run the loop until a None command (or until it dies, logged); then abort what is
    unfinished, close the engine and emit ("closed",)."""
    try:
        _loop(engine, inbox, emit)
    except Exception:
        log.exception("the engine loop died")
    finally:
        try:
            for rid in list(engine.requests):
                engine.abort(rid)
        except Exception:
            log.exception("aborting the unfinished requests failed")
        engine.close()  # a multi-rank engine's workers, if any
        emit(("closed",))


def _loop(engine: Engine, inbox: Inbox, emit: Callable[[tuple], None]) -> None:
    wait: float | None = None
    while True:
        if not engine.has_unfinished():
            emit(("stats", engine.stats()))
            wait = None  # block until a command arrives
        try:
            cmd = inbox.next(wait)
            while True:
                if cmd is None:
                    return
                _handle(engine, cmd, emit)
                cmd = inbox.next(0)
        except queue.Empty:
            pass
        rounds = engine.scheduler.counters["rounds"]
        if engine.has_unfinished():
            _step(engine, emit)
        # nothing could be scheduled (e.g. waiting for memory): wait a little, do not spin
        wait = 0 if engine.scheduler.counters["rounds"] > rounds else STALL_WAIT_S


def _handle(engine: Engine, cmd: tuple, emit: Callable[[tuple], None]) -> None:
    kind, *args = cmd
    if kind == "abort":
        engine.abort(args[0])
    elif kind == "add":
        rid, prompt, params = args
        try:
            engine.add_request(prompt, params, rid, outputs="delta")
        except Exception as e:  # ValueError: bad input
            emit(("added", rid, e))
        else:
            emit(("added", rid, None))
    else:  # call
        n, fn = args
        try:
            result = fn(engine)
        except Exception as e:  # belongs to the caller
            emit(("result", n, None, e))
        else:
            emit(("result", n, result, None))


def _step(engine: Engine, emit: Callable[[tuple], None]) -> None:
    try:
        outs = engine.step()
    except Exception:
        log.exception("engine step failed; failing its batch")
        emit(("step", [], engine.fail_inflight(), engine.stats()))
        return
    failed = engine.sampler.take_failures()
    for rid, exc in failed.items():
        log.error("sampling failed for request %s (%s: %s); failing that request", rid, type(exc).__name__, exc)
        engine.abort(str(rid))
    emit(("step", outs, [str(r) for r in failed], engine.stats()))
