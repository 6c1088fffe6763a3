"""AsyncEngine: a served engine's front, requests in and outputs out over asyncio queues.

    asyncio side                        engine side (hybridserve/engine_loop.py)
    add()      -> ("add") ---------->   engine.add_request   (ValueError -> the add's await)
    abort()    -> ("abort") -------->   engine.abort         (pages and slot freed)
    submit(fn) -> ("call") --------->   fn(engine)           (-> a concurrent Future)
    per-request asyncio.Queue  <-----   ("step") events: each step's outputs, one call_soon_threadsafe
This class runs the engine on a background thread of this process; EngineProcess
(hybridserve/engine_process.py) runs it in a child process behind the same front. Events
arrive on one thread (the engine thread, or the thread reading the child's pipe), which alone
delivers them; `info` (EngineInfo) is what the front knows of the engine without its model.

On CPU the engine thread should be the only thread of the process that runs parallel torch
work, so `AsyncEngine.build` constructs the engine (weights loaded, kernels built) on that
thread. libgomp keeps a team of threads for every thread that ever ran a parallel region;
once the process holds more of them than CPUs, every waiting thread spins only ~100
iterations and then sleeps (its "throttled" spin), and each parallel region pays a futex
wake-up. A model loaded on the main thread and stepped on this one made a 2-thread decode
step of the Qwen3-Next peer checkpoint 1.5x slower (25-29 against 17-18 ms) and a [64, 256]
bf16 linear 6x slower (100 against 17 us).

Memory per request is bounded: the queue holds deltas (an unfinished output without the
prompt, text and ids accumulated so far; the last one is whole), at most `backlog` of them; a
reader that falls further behind has its request aborted and gets an EngineError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Callable, NamedTuple, Sequence

import torch

from hybridserve.engine import Engine
from hybridserve.engine_info import EngineInfo
from hybridserve.engine_loop import QueueInbox, serve_engine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

log = logging.getLogger("hybridserve.engine")
BACKLOG = 1024  # outputs a request's reader may fall behind before the request is aborted


class EngineError(RuntimeError):
    """A request failed inside the engine (not because of its input). `code` says why:
    "engine_error" (a step or its sampling raised), "shutting_down", "slow_reader"."""

    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.code = code


FAILED = "the engine failed while running this request"
STOPPED = "the server is shutting down; the request was not finished"


class _Sink(NamedTuple):
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | EngineError; put() only from the loop


class EngineFront:
    """What a served engine's front does wherever the engine runs: requests in (add, abort,
    submit), events out to per-request asyncio queues. A subclass runs the engine (alive,
    start, shutdown) and carries commands to it (_post); `_event` receives its events on one
    thread. `backlog` bounds each request's queue of outputs."""

    def __init__(self, info: EngineInfo, threads: int | None, backlog: int, stats: dict):
        if backlog < 1:
            raise ValueError(f"backlog must be >= 1, got {backlog}")
        self.info, self.threads, self.backlog = info, threads, backlog
        self.stats: dict = stats  # snapshot, refreshed by the engine's events
        self._sinks: dict[str, _Sink] = {}  # rid -> its queue, once added
        self._adds: dict[str, tuple[_Sink, Future]] = {}  # rid -> (its queue, the add's answer): sent, not answered
        self._calls: dict[int, Future] = {}
        self._ids, self._calls_n = itertools.count(), itertools.count()
        self._stopping = False

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def _post(self, cmd: tuple | None) -> None:
        raise NotImplementedError

    # -- requests (any thread / the event loop) ------------------------------------------

    async def add(self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None = None
                  ) -> "RequestStream":
        """Add a request; ValueError (from the engine) for input it cannot serve. Iterate the
        returned stream for its outputs; close() it to abort the request."""
        rid = rid or f"r{next(self._ids)}"
        sink, answer = _Sink(asyncio.get_running_loop(), asyncio.Queue()), Future[str]()
        self._adds[rid] = (sink, answer)  # before the check: an engine closing after it fails the answer
        if err := self._refusal():
            self._adds.pop(rid, None)
            raise err
        self._post(("add", rid, prompt, params))
        try:
            await asyncio.wrap_future(answer)
        except asyncio.CancelledError:
            self.abort(rid)  # queued after the add: the engine sees them in this order
            raise
        return RequestStream(self, rid, sink.queue)

    def abort(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._adds.pop(rid, None)
        if not self._stopping:
            self._post(("abort", rid))

    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the engine's side between steps; its result as a Future (for an
        engine in another process fn must pickle: a module-level function or method)."""
        fut: Future = Future()
        n = next(self._calls_n)
        self._calls[n] = fut
        if err := self._refusal():
            self._calls.pop(n, None)
            fut.set_exception(err)
        else:
            self._post(("call", n, fn))
        return fut

    def _refusal(self) -> EngineError | None:
        if self._stopping or not self.alive:
            return EngineError("the engine is not running", "shutting_down")
        return None

    # -- events (the one thread that receives them) --------------------------------------

    def _event(self, event: tuple) -> None:
        kind, *args = event
        if kind == "step":
            outs, failed, self.stats = args
            self._fail(failed)
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for o in outs:
                sink = self._sinks.pop(o.rid, None) if o.finished else self._sinks.get(o.rid)
                if sink is not None:
                    by_loop.setdefault(sink.loop, []).append((sink.queue, o))
            for loop, items in by_loop.items():
                self._deliver(loop, items)
        elif kind == "added":
            rid, error = args
            entry = self._adds.pop(rid, None)
            if entry is None:  # aborted before the engine answered
                return
            if error is not None:
                entry[1].set_exception(error)
            else:
                self._sinks[rid] = entry[0]
                entry[1].set_result(rid)
        elif kind == "result":
            n, value, error = args
            fut = self._calls.pop(n, None)
            if fut is None:
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
        elif kind == "stats":
            self.stats = args[0]
        else:  # closed
            self._close()

    def _fail(self, rids) -> None:
        """Hand each of rids (already aborted in the engine) an EngineError; the cause is in
        the log, not in the error a client sees."""
        err = EngineError(FAILED)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid in dict.fromkeys(rids):
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink.queue, err))
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _deliver(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        """Put (queue, item) pairs on their queues from the receiving thread; a closed loop drops
        them. An error or a last output always goes in; an unfinished output that finds
        `backlog` items waiting is replaced by an EngineError "slow_reader" and its request
        aborted (later ones are dropped)."""
        def put():
            for q, item in items:
                if isinstance(item, Exception) or item.finished or q.qsize() < self.backlog:
                    q.put_nowait(item)
                elif q.qsize() == self.backlog:
                    q.put_nowait(EngineError(f"the client fell {self.backlog} outputs behind; the request was "
                                             "aborted", "slow_reader"))
                    self.abort(item.rid)

        try:
            loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening

    def _close(self) -> None:
        """The engine stopped: whoever waits gets an EngineError."""
        self._stopping = True
        err = EngineError(STOPPED, "shutting_down")
        for sink in list(self._sinks.values()):
            self._deliver(sink.loop, [(sink.queue, err)])
        self._sinks.clear()
        for waiting in [*(f for _, f in list(self._adds.values())), *list(self._calls.values())]:
            if not waiting.done():
                waiting.set_exception(err)
        self._adds.clear()
        self._calls.clear()



class AsyncEngine(EngineFront):
    """The front of an `Engine` stepped on a background thread of this process. `threads` sets
    torch's intra-op threads on the engine thread (None: leave as is)."""

    def __init__(self, engine: Engine, threads: int | None = None, backlog: int = BACKLOG):
        super().__init__(engine.info, threads, backlog, engine.stats())
        self.engine = engine
        self._inbox = QueueInbox()
        self._thread: threading.Thread | None = None

    @classmethod
    def build(cls, make: Callable[[], Engine], threads: int | None = None, backlog: int = BACKLOG
              ) -> "AsyncEngine":
        """Run make() on a new engine thread and serve the engine it returns from that thread
        (already started); make()'s exception is raised here and no thread is left behind."""
        built: Future = Future()

        def run() -> None:
            try:
                if threads:
                    torch.set_num_threads(threads)
                front = cls(make(), threads, backlog)
            except BaseException as e:  # noqa: BLE001  (handed to the caller)
                built.set_exception(e)
                return
            front._thread = threading.current_thread()
            built.set_result(front)
            front._run()

        threading.Thread(target=run, name="hybridserve-engine", daemon=True).start()
        return built.result()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine: already started")
        self._thread = threading.Thread(target=self._run, name="hybridserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is unfinished (its readers get EngineError "shutting_down"), stop the
        engine and wait for it."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._post(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        serve_engine(self.engine, self._inbox, self._event)

    def _post(self, cmd: tuple | None) -> None:
        self._inbox.put(cmd)


class RequestStream:
    """The outputs of one request, in order (an EngineError if it fails); close() aborts
    it if it has not finished."""

    def __init__(self, engine: EngineFront, rid: str, outputs: asyncio.Queue):
        self.engine, self.rid, self.queue = engine, rid, outputs
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if isinstance(out, Exception):
            self.finished = True
            raise out
        self.finished = out.finished
        return out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.rid)
