"""EngineProcess: the engine in a child process behind the front AsyncEngine has (`serve --engine-process`).

    front process (HTTP, tokenizer)              engine process (spawned; the only caller of Engine)
    add / abort / submit  -- commands, pipe -->  hybridserve/engine_loop.py's loop
    reader thread         <-- events, pipe ---   one ("step", deltas, failed, stats) a step

In one process the server's event loop (each token's socket write, HTTP parsing, JSON) and
the engine's Python between kernels take turns on the GIL; in two they run side by side, and
an engine that crashes (a kernel's fault included) leaves the server up, answering 503. On
a host with two vCPUs the front's work still takes the engine's cores, and served runs of the
Qwen3-Next peer checkpoint were faster in one setting and slower in another than with the
engine on a thread (docs/benchmarks.md), so a thread stays the default.

What crosses the pipe is small: "delta" outputs carry no prompt (hybridserve/outputs.py);
pickling each request's 1,280 prompt ids every step made served runs 30% slower. The front
validates and tokenizes with its own tokenizer and the engine's limits (EngineInfo), so a
bad request never reaches the engine process. The engine process ignores SIGINT and SIGTERM
(the front shuts it down, gracefully) and ends when the front's end of the pipe closes,
whatever ended the front. Its ThreadGovernor counts the front's CPU as its own. If it dies,
waiting requests get an EngineError and `alive` is False (/health answers 503).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection

import torch

from hybridserve.async_engine import BACKLOG, EngineFront
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine, load_tokenizer, model_path
from hybridserve.engine_loop import serve_engine
from hybridserve.host import freeze_heap

log = logging.getLogger("hybridserve.engine")
STOP_WAIT_S = 30.0  # after this, an engine process that did not stop when asked is killed


class EngineProcess(EngineFront):
    """`EngineProcess(config)`: spawn the engine process, build the engine there (its exception
    is raised here, and no process is left behind) and serve it."""

    def __init__(self, config: EngineConfig, threads: int | None = None, backlog: int = BACKLOG):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self._pipe, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_main, args=(config, theirs, threads), name="hybridserve-engine",
                                 daemon=True)
        self._proc.start()
        theirs.close()
        try:
            tokenizer = load_tokenizer(config.model, model_path(config))  # while the engine builds
            kind, payload = self._pipe.recv()
        except EOFError:
            self._proc.join()
            self._pipe.close()
            raise RuntimeError(f"the engine process exited with status {self._proc.exitcode} while starting") from None
        except BaseException:
            self._proc.kill()
            self._pipe.close()
            raise
        if kind == "failed":
            self._proc.join()
            self._pipe.close()
            raise payload
        info, stats = payload
        super().__init__(dataclasses.replace(info, tokenizer=tokenizer), threads, backlog, stats)
        self._send_lock = threading.Lock()
        self._ended = False  # the reader saw the engine's last event or the pipe's end
        self._reader = threading.Thread(target=self._read, name="hybridserve-engine-events", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._ended and self._proc.is_alive()

    def start(self) -> None:
        """Started at construction."""

    def shutdown(self, timeout: float = STOP_WAIT_S) -> None:
        """Abort what is unfinished (its readers get EngineError "shutting_down"), stop the
        engine process and wait for it (killed after `timeout`)."""
        if not self._stopping:
            self._stopping = True
            self._post(None)
        self._reader.join(timeout)
        self._proc.join(timeout if self._proc.is_alive() else 0)
        if self._proc.is_alive():
            log.error("the engine process did not stop in %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join()
        if not self._reader.is_alive():
            self._pipe.close()

    def _post(self, cmd: tuple | None) -> None:
        try:
            with self._send_lock:
                self._pipe.send(cmd)
        except (OSError, ValueError):  # the engine process is gone: the reader fails what waits
            pass

    def _read(self) -> None:
        try:
            while (event := self._pipe.recv())[0] != "closed":
                self._event(event)
        except (EOFError, OSError):
            log.error("the engine process ended (exit status %s); failing the requests it held", self._proc.exitcode)
        except Exception:
            log.exception("delivering the engine's events failed; failing the requests it held")
        finally:
            self._ended = True
            self._close()


def _engine_main(config: EngineConfig, pipe: Connection, threads: int | None) -> None:
    """The engine process: build, say so, then serve the pipe's commands until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = Engine(config)
    except BaseException as e:  # noqa: BLE001  (raised in the front)
        pipe.send(("failed", _portable(e)))
        return
    engine.cpu_partners = (os.getppid(),)
    freeze_heap()  # as the server does: full collections walk only what comes after start-up
    pipe.send(("ready", (dataclasses.replace(engine.info, tokenizer=None), engine.stats())))
    serve_engine(engine, _PipeInbox(pipe), lambda event: _send(pipe, event))


class _PipeInbox:
    def __init__(self, pipe: Connection):
        self.pipe = pipe

    def next(self, timeout: float | None) -> tuple | None:
        if not self.pipe.poll(timeout):
            raise queue.Empty
        try:
            return self.pipe.recv()
        except EOFError:  # the front is gone: stop
            return None


def _send(pipe: Connection, event: tuple) -> None:
    kind, *args = event
    if kind in ("added", "result") and args[-1] is not None:
        event = (kind, *args[:-1], _portable(args[-1]))
    try:
        pipe.send(event)
    except OSError:  # the front is gone; the loop sees the pipe's end next
        pass
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a call's result that does not pickle
        if kind != "result":
            raise
        pipe.send(("result", args[0], None, RuntimeError(f"the result could not be sent back: {e}")))


def _portable(e: BaseException) -> BaseException:
    """e if it pickles, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
