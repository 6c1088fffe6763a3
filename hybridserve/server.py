"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. `build_app(async_engine)` makes the FastAPI app; `serve(config, host,
port)` builds the engine and runs it under uvicorn (SIGTERM: uvicorn's graceful shutdown,
then the lifespan stops the engine thread).

Bad input is answered before the request runs, with a 4xx in the OpenAI error
shape {"error": {"message", "type", "param", "code"}}; a client that goes away aborts its
request, which frees its pages and slot.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.async_engine import AsyncEngine, EngineError, RequestStream
from hybridserve.config import EngineConfig
from hybridserve.metrics import Metrics, RequestTimer
from hybridserve.outputs import RequestOutput
from hybridserve.protocol import ChatRequest, CompletionRequest, SamplingRequest, describe_validation_error

log = logging.getLogger(__name__)
DEFAULT_CHAT_MAX_TOKENS = 256  # chat requests that set no max_completion_tokens / max_tokens
GRACEFUL_SHUTDOWN_S = 10  # after SIGTERM, open streams get this long before they are cancelled


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class BearerAuth:
    """ASGI middleware: every /v1 route needs `Authorization: Bearer <key>` (401 otherwise);
    /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
              api_key: str | None = None) -> FastAPI:
    """The app serving `engine`; its lifespan starts the engine thread and stops it. With
    `api_key`, every /v1 route requires it as a bearer token."""
    metrics = Metrics(lambda: engine.stats)
    names = {engine.model_name, engine.engine.config.model}

    @asynccontextmanager
    async def lifespan(_app):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="hybridserve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _server_error(_req, e: Exception):
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine thread is not running", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        e = engine.engine
        return {"object": "list", "data": [{"id": e.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "hybridserve", "max_model_len": e.max_model_len}]}

    async def respond(raw: Request, model: type[SamplingRequest]):
        timer = metrics.request()
        req = await parse(raw, model)
        if req.model is not None and req.model not in names:
            raise APIError(404, f"model: {req.model!r} does not exist; this server serves {engine.model_name!r}",
                           "model", "model_not_found")
        rid = f"{req.id_prefix}-{uuid.uuid4().hex}"
        tok = engine.engine.tokenizer
        try:
            prompt = req.engine_prompt(tok)
            params = req.sampling_params(chat_max_tokens)
            run = Run(await engine.add(prompt, params, rid), timer)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e), model)) from None
        except EngineError as e:
            raise APIError(503, str(e), kind="server_error") from None
        head = {"id": rid, "object": req.chunk_object_name if req.stream else req.object_name,
                "created": int(time.time()), "model": engine.model_name}
        if req.stream:
            return sse(run, req, head, tok)
        outs = await run.collect(raw)
        lp = req.format_logprobs(tok, *outs) if req.wants_logprobs else None
        last = outs[-1]
        return {**head, "choices": [req.choice(last.text, last.finish_reason, lp)], "usage": last.usage}

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await respond(raw, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await respond(raw, ChatRequest)

    return app


class Run:
    """A request as the server sees it: the engine's outputs, timed; close() aborts it if the
    client is gone before it finished."""

    def __init__(self, stream: RequestStream, timer: RequestTimer):
        self.stream, self.timer = stream, timer

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.stream:
                self.timer.tokens(len(out.new_token_ids))
                if out.finished:
                    if out.finish_reason is None:
                        raise RuntimeError(f"request {out.rid}: finished without a finish_reason")
                    self.timer.finish(out.finish_reason, out.usage)
                yield out
        except EngineError:
            self.timer.finish("error")
            raise

    async def collect(self, raw: Request) -> list[RequestOutput]:
        """All outputs (non-stream); the request is aborted if the client disconnects first."""
        work = asyncio.ensure_future(self._all())
        gone = asyncio.ensure_future(disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise APIError(499, "the client closed the connection", kind="client_closed")
            return work.result()
        except EngineError as e:
            raise APIError(500, str(e), kind="server_error") from None
        finally:
            gone.cancel()
            self.close()

    async def _all(self) -> list[RequestOutput]:
        return [out async for out in self.outputs()]

    def close(self) -> None:
        if not self.stream.finished:
            self.stream.close()
            self.timer.finish("abort")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends (done, client gone,
    server shutting down)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse(run: Run, req: SamplingRequest, head: dict, tokenizer) -> SSEResponse:
    """`data: {json}` chunks (one per output that adds text or logprobs, and the last), the
    usage chunk if asked, then `data: [DONE]`; a failure becomes an error event."""
    async def events():
        first = True
        try:
            async for out in run.outputs():
                text = out.new_text
                lp = req.format_logprobs(tokenizer, out) if req.wants_logprobs else None
                if first or text or lp or out.finished:
                    yield event({**head, "choices": [req.choice(text, out.finish_reason, lp, first)]})
                    first = False
                if out.finished and req.include_usage:
                    yield event({**head, "choices": [], "usage": out.usage})
        except EngineError as e:
            yield event(APIError(500, str(e), kind="server_error").body())
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), run.close)


async def disconnected(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def parse(raw: Request, model: type[SamplingRequest]) -> SamplingRequest:
    try:
        data = json.loads(await raw.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body: must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        param, message = describe_validation_error(e)
        raise APIError(400, message, param) from None


def param_of(message: str, model) -> str | None:
    """The first request field a message names, if any."""
    fields = set(model.model_fields) | {"prompt"}  # the engine says "prompt" for chat messages too
    for word in re.findall(r"[A-Za-z_]+", message):
        if word in fields:
            return word
    return None


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          api_key: str | None = None) -> None:
    """Build the engine from `config` and serve it until SIGINT / SIGTERM."""
    import uvicorn

    from hybridserve.engine import Engine

    app = build_app(AsyncEngine(Engine(config)), api_key=api_key)
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach this address can use the server", host)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
