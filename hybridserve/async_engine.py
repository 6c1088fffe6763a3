"""AsyncEngine: the Engine on one background thread, requests and outputs over queues.

    asyncio side                      engine thread (the only caller of Engine)
    add()      -> inbox ("add") --->  engine.add_request   (ValueError -> the add future)
    abort()    -> inbox ("abort") ->  engine.abort         (pages and slot freed)
    submit(fn) -> inbox ("call") -->  fn(engine)           (-> a concurrent Future)
    per-request asyncio.Queue  <----  engine.step() outputs, one call_soon_threadsafe a step
When nothing is unfinished the thread blocks on the inbox; a step that raises fails only
the requests of the batch it was running, a row whose sampling raised fails only its
request, and the loop goes on.

On CPU the engine thread should be the only thread of the process that runs parallel torch
work, so `AsyncEngine.build` constructs the engine (weights loaded, kernels built) on that
thread. libgomp keeps a team of threads for every thread that ever ran a parallel region;
once the process holds more of them than CPUs, every waiting thread spins only ~100
iterations and then sleeps (its "throttled" spin), and each parallel region pays a futex
wake-up. A model loaded on the main thread and stepped on this one made a 2-thread decode
step of the Qwen3-Next peer checkpoint 1.5x slower (25-29 against 17-18 ms) and a [64, 256]
bf16 linear 6x slower (100 against 17 us).

Memory per request is bounded: the queue holds deltas (an unfinished output without the
text and ids accumulated so far; the last one is whole), at most `backlog` of them; a
reader that falls further behind has its request aborted and gets an EngineError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable, NamedTuple, Sequence

import torch

from hybridserve.engine import Engine
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

log = logging.getLogger("hybridserve.engine")
STALL_WAIT_S = 0.005
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


class AsyncEngine:
    """Thread-safe front of an `Engine`. `threads` sets torch's intra-op threads on the
    engine thread (None: leave as is); `backlog` bounds each request's queue of outputs."""

    def __init__(self, engine: Engine, threads: int | None = None, backlog: int = BACKLOG):
        if backlog < 1:
            raise ValueError(f"backlog must be >= 1, got {backlog}")
        self.engine = engine
        self.threads = threads
        self.backlog = backlog
        self.stats: dict = engine.stats()  # snapshot, refreshed by the engine thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

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
    def model_name(self) -> str:
        return self.engine.model_name

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
        thread and join it."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- requests (any thread / the event loop) ------------------------------------------

    async def add(self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None = None
                  ) -> "RequestStream":
        """Add a request; ValueError (from the engine) for input it cannot serve. Iterate the
        returned stream for its outputs; close() it to abort the request."""
        rid = rid or f"r{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        try:
            await asyncio.wrap_future(self._send("add", rid, prompt, params, sink))
        except asyncio.CancelledError:
            self.abort(rid)  # queued after the add: the engine sees them in this order
            raise
        return RequestStream(self, rid, sink.queue)

    def abort(self, rid: str) -> None:
        if not self._stopping:
            self._inbox.put(("abort", rid))

    def submit(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the engine thread between steps; its result as a Future."""
        return self._send("call", fn)

    def _send(self, *cmd) -> Future:
        fut: Future = Future()
        if self._stopping or not self.alive:
            fut.set_exception(EngineError("the engine is not running", "shutting_down"))
        else:
            self._inbox.put((*cmd, fut))
        return fut

    # -- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            self._loop()
        except Exception:
            log.exception("the engine loop died")
        finally:
            self._stopping = True
            self._close()

    def _loop(self) -> None:
        engine, idle_wait = self.engine, None
        while True:
            if not engine.has_unfinished():
                self.stats = engine.stats()
                idle_wait = None  # block until a command arrives
            try:
                cmds = [self._inbox.get(timeout=idle_wait) if idle_wait != 0 else self._inbox.get_nowait()]
            except queue.Empty:
                cmds = []
            while not self._inbox.empty():
                cmds.append(self._inbox.get())
            for cmd in cmds:
                if cmd is None:
                    return
                self._handle(cmd)
            rounds = engine.scheduler.counters["rounds"]
            if engine.has_unfinished():
                self._step()
            # nothing could be scheduled (e.g. waiting for memory): wait a little, do not spin
            idle_wait = 0 if engine.scheduler.counters["rounds"] > rounds else STALL_WAIT_S

    def _handle(self, cmd: tuple) -> None:
        kind, *args = cmd
        if kind == "abort":
            self._sinks.pop(args[0], None)
            self.engine.abort(args[0])
            return
        *args, fut = args
        try:
            if kind == "add":
                rid, prompt, params, sink = args
                result = self.engine.add_request(prompt, params, rid, outputs="delta")
                self._sinks[rid] = sink
            else:
                result = args[0](self.engine)
        except Exception as e:  # ValueError: bad input; anything else belongs to the caller
            fut.set_exception(e)
        else:
            fut.set_result(result)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing its batch")
            self._fail(self.engine.fail_inflight())
            return
        failed = self.engine.sampler.take_failures()
        for rid, exc in failed.items():
            log.error("sampling failed for request %s (%s: %s); failing that request", rid, type(exc).__name__, exc)
            self.engine.abort(str(rid))
        self._fail(failed)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for o in outs:
            sink = self._sinks.pop(o.rid, None) if o.finished else self._sinks.get(o.rid)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink.queue, o))
        for loop, items in by_loop.items():
            self._deliver(loop, items)
        self.stats = self.engine.stats()

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
        """Put (queue, item) pairs on their queues from the engine thread; a closed loop drops
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
        """Abort what is unfinished; whoever waits gets an EngineError."""
        try:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        except Exception:
            log.exception("aborting the unfinished requests failed")
        self.engine.close()  # a multi-rank engine's workers, if any
        err = EngineError(STOPPED, "shutting_down")
        for sink in self._sinks.values():
            self._deliver(sink.loop, [(sink.queue, err)])
        self._sinks.clear()
        while not self._inbox.empty():
            cmd = self._inbox.get()
            if cmd and isinstance(cmd[-1], Future):
                cmd[-1].set_exception(err)


class RequestStream:
    """The outputs of one request, in order (an EngineError if it fails); close() aborts
    it if it has not finished."""

    def __init__(self, engine: AsyncEngine, rid: str, outputs: asyncio.Queue):
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
