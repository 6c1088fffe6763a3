"""`serve()`: the app under uvicorn, with the limits of a ServerConfig and a clean shutdown.

    connection limits   at most max_connections open (one more is closed at once, a request
                        beyond it gets a 503); a connection must send a whole request (head
                        and body) within request_timeout_s of opening or of its previous
                        response; idle keep-alive connections close after keep_alive_s
    SIGTERM / SIGINT    stop accepting; open requests get shutdown_grace_s to finish; then
                        the engine stops and each one left gets an OpenAI-shaped error (503
                        JSON, or an error event and `data: [DONE]` on a stream); the exit
                        status is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT)
    out of descriptors  logged once a minute, without tracebacks
    garbage collection  what is alive once the server has started is frozen out of Python's
                        collections, which then walk only newer objects (hybridserve/host.py)
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridserve.async_engine import AsyncEngine, EngineFront
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine
from hybridserve.engine_process import EngineProcess
from hybridserve.host import freeze_heap
from hybridserve.server import build_app
from hybridserve.server_config import LOOPBACK, ServerConfig

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
SHUTDOWN_MARGIN_S = 5  # after the grace period: time for the errors to be written before uvicorn cancels
HEAD_LIMIT = 64 * 1024  # bytes of a request line and headers (h11's own default)


class Once:
    """Logs a condition at most once per `every` seconds (a flood of one event is one line)."""

    def __init__(self, every: float = 60.0):
        self.every, self.last = every, float("-inf")

    def warn(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.warning(msg + " (logged at most once a minute)", *args)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a connection cap and a deadline for each request to
    arrive whole (against idle and slowloris connections); limits come from `server_config`
    on the uvicorn config."""

    refused = Once()
    slow = Once()

    def connection_made(self, transport) -> None:
        limits: ServerConfig = self.config.server_config  # type: ignore[attr-defined]
        self.timeout = limits.request_timeout_s
        self.deadline: asyncio.TimerHandle | None = None
        if len(self.connections) >= limits.max_connections:
            self.refused.warn("%d connections open: closing new ones (--max-connections)", len(self.connections))
            self.transport = transport
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()  # the clock of the next request starts with its first byte at the latest
        super().data_received(data)
        if not self._arriving():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # keep-alive: uvicorn's own timer runs until data arrives

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arriving(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _arm(self) -> None:
        if self.deadline is None:
            self.deadline = self.loop.call_later(self.timeout, self._too_slow)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _too_slow(self) -> None:
        self.deadline = None
        if not self.transport.is_closing() and self._arriving():
            self.slow.warn("closed a connection that sent no whole request in %.0f s (--request-timeout-s)",
                           self.timeout)
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server with the shutdown above; `exit_status` after `run()`."""

    def __init__(self, config: uvicorn.Config, engine: EngineFront, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.signal: int | None = None

    @property
    def exit_status(self) -> int:
        return 128 + self.signal if self.signal is not None else 0

    def handle_exit(self, sig: int, frame) -> None:
        self.signal = self.signal or sig
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's handlers, without raising the signal again afterwards (the exit status
        carries it instead; raised again, SIGINT would end as a KeyboardInterrupt with status 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(_loop_exception)
        await super().startup(sockets)
        log.debug("%d objects frozen out of garbage collection", freeze_heap())  # see hybridserve/host.py

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.create_task(self._drain())
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()
            gc.unfreeze()

    async def _drain(self) -> None:
        """After the grace period, stop the engine: whoever still waits gets its error."""
        deadline = time.monotonic() + self.grace
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.server_state.connections:
            log.info("shutdown: %d connection(s) still open after %.0f s; failing their requests",
                     len(self.server_state.connections), self.grace)
        await asyncio.to_thread(self.engine.shutdown)


_out_of_descriptors = Once()


def _loop_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """asyncio's handler, except that running out of descriptors (accept() fails on every
    retry) is one line a minute instead of a traceback each time."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and "accept" in context.get("message", ""):
        _out_of_descriptors.warn("cannot accept connections: %s", exc)
        return
    loop.default_exception_handler(context)


def _raise_descriptor_limit(connections: int) -> None:
    """Lift the soft limit on open files towards the hard one so `connections` fit beside the
    model's files; warn if they still do not."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if soft < want:
            log.warning("open-file limit %d is below --max-connections %d + 256; lower --max-connections", soft,
                        connections)


def serve(config: EngineConfig, server: ServerConfig | None = None, log_level: str = "info") -> int:
    """Build the engine from `config` and serve it until SIGINT / SIGTERM; the exit status."""
    server = server or ServerConfig()
    _raise_descriptor_limit(server.max_connections)
    if server.engine_process:
        engine: EngineFront = EngineProcess(config, backlog=server.stream_backlog)
    else:
        engine = AsyncEngine.build(lambda: Engine(config), backlog=server.stream_backlog)  # built on its thread
    app = build_app(engine, server)
    if not server.api_key and server.host not in LOOPBACK:
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the server",
                    server.host)
    uv = uvicorn_config(app, server, log_level)
    s = Server(uv, engine, server.shutdown_grace_s)
    try:
        s.run()
    finally:
        engine.shutdown()  # a no-op after the drain; stops the engine if the server never started
    return s.exit_status


def uvicorn_config(app, server: ServerConfig, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for `server`'s address and limits, with GuardedH11Protocol."""
    uv = uvicorn.Config(app, host=server.host, port=server.port, log_level=log_level, http=GuardedH11Protocol,
                        limit_concurrency=server.max_connections + 1, timeout_keep_alive=server.keep_alive_s,
                        h11_max_incomplete_event_size=HEAD_LIMIT,
                        timeout_graceful_shutdown=int(server.shutdown_grace_s + SHUTDOWN_MARGIN_S))
    uv.server_config = server  # type: ignore[attr-defined]  # read by GuardedH11Protocol
    return uv
