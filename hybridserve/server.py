"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. `build_app(engine_front, config)` makes the FastAPI app (its lifespan
starts the engine and stops it: AsyncEngine, on a thread, or EngineProcess, in its own
process); hybridserve/http_server.py runs it under uvicorn.

Bad input is answered before the request runs, with a 4xx in the OpenAI error
shape {"error": {"message", "type", "param", "code"}}; a client that goes away aborts its
request, which frees its pages and slot. A request's body is read within its size limit on
the event loop, then parsed, validated and tokenized on one worker thread (neither the
event loop nor the engine waits for that); the engine gets token ids.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridserve.async_engine import EngineError, EngineFront, RequestStream
from hybridserve.engine import Engine
from hybridserve.guards import BearerAuth, HostCheck, error_response
from hybridserve.metrics import Metrics, RequestTimer
from hybridserve.openapi import openapi_schema, route_docs
from hybridserve.outputs import RequestOutput
from hybridserve.protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest, describe_validation_error
from hybridserve.sampling import SamplingParams
from hybridserve.server_config import ServerConfig
from state_cache import IntegrityError

log = logging.getLogger(__name__)
JSON_TYPES = ("application/json",)
QUEUE_TIMEOUT = "queue_timeout"  # the finish_reason of a request that waited past the scheduler's queue timeout
IGNORED_SETS = 64  # distinct sets of unknown request fields warned about (then one last warning, then none)
IGNORED_NAMED, IGNORED_NAME_CHARS = 8, 40  # per warning: fields named, characters of each name


def build_app(engine: EngineFront, config: ServerConfig | None = None, **settings) -> FastAPI:
    """The app serving `engine` under `config` (fields of ServerConfig may be given as
    keywords: build_app(engine, api_key=KEY)). With an API key every /v1 route requires it
    as a bearer token; the Host header is checked against `config.host_names`."""
    config = dataclasses.replace(config or ServerConfig(), **settings)
    metrics = Metrics(lambda: engine.stats)
    info = engine.info  # the engine runs on a thread of this process or in another (EngineProcess)
    names = {info.model_name, info.config.model}
    worker = ThreadPoolExecutor(1, thread_name_prefix="hybridserve-parse")  # one: tokenizers are not reentrant

    @asynccontextmanager
    async def lifespan(_app):
        if not engine.alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hybridserve", lifespan=lifespan, docs_url="/docs" if config.docs else None, redoc_url=None)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key)
    if config.host_names is not None:
        app.add_middleware(HostCheck, names=config.host_names)

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), code=code, headers=e.headers))

    @app.exception_handler(Exception)
    async def _server_error(_req, e: Exception):  # logged with its traceback by the server, not echoed
        return error_response(APIError(500, "internal server error", kind="server_error", code="internal_error"))

    @app.get("/health", **route_docs("health"))
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine is not running", kind="server_error", code="engine_not_running")
        return {"status": "ok"}

    if info.config.debug_integrity:
        @app.post("/debug/audit", **route_docs("audit"))
        async def audit():
            """Flush the cache, check every pool and count what is still held (all 0: no leak);
            409 while requests run. Only with --debug-integrity."""
            try:
                return await asyncio.wrap_future(engine.submit(Engine.audit))  # pickles: run in another process
            except IntegrityError as err:  # a debug route: say what broke
                raise APIError(500, f"integrity check failed: {err}", kind="server_error",
                               code="integrity_error") from err
            except RuntimeError as err:
                raise APIError(409, str(err), kind="invalid_request_error", code="busy") from err

    @app.get("/metrics", response_class=PlainTextResponse, **route_docs("metrics"))
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models", **route_docs("models"))
    async def models():
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "hybridserve", "max_model_len": info.max_model_len}]}

    def prepare(body: bytes, model: type[SamplingRequest]) -> tuple[SamplingRequest, SamplingParams, list[int]]:
        """On the worker: the request, its sampling and its prompt's token ids (APIError or
        ValueError for bad input)."""
        req = decode(body, model)
        if req.model is not None and req.model not in names:
            raise APIError(404, f"model: {req.model!r} does not exist; this server serves {engine.model_name!r}",
                           "model", "model_not_found")
        params = req.sampling_params(config.chat_max_tokens)
        return req, params, info.validate(req.engine_prompt(info.tokenizer), params)

    async def respond(raw: Request, model: type[SamplingRequest]):
        timer = metrics.request()
        body = await read_body(raw, config.max_body_bytes)
        rid = f"{model.id_prefix}-{uuid.uuid4().hex}"
        try:
            req, params, ids = await asyncio.get_running_loop().run_in_executor(worker, prepare, body, model)
            run = Run(await engine.add(ids, params, rid), timer)
        except ValueError as e:
            raise APIError(400, str(e), param_of(str(e), model)) from None
        except EngineError as e:
            raise APIError(503, str(e), kind="server_error", code=e.code) from None
        tok = info.tokenizer
        head = {"id": rid, "object": req.chunk_object_name if req.stream else req.object_name,
                "created": int(time.time()), "model": engine.model_name}
        if req.stream:
            return sse(run, req, head, tok)
        outs = await run.collect(raw)
        last = outs[-1]
        if last.finish_reason == QUEUE_TIMEOUT:
            raise queue_timeout()
        lp = req.format_logprobs(tok, *outs) if req.wants_logprobs else None
        return {**head, "choices": [req.choice(last.text, last.finish_reason, lp)], "usage": last.usage}

    @app.post("/v1/completions", **route_docs("completions"))
    async def completions(raw: Request):
        return await respond(raw, CompletionRequest)

    @app.post("/v1/chat/completions", **route_docs("chat"))
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
            raise engine_error(e) from None
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
    usage chunk if asked, then `data: [DONE]`; a failure (the engine's, a queue timeout, a
    shutdown) becomes an error event before the `[DONE]`."""
    async def events():
        first = True
        try:
            async for out in run.outputs():
                if out.finish_reason == QUEUE_TIMEOUT:
                    yield event(queue_timeout().body())
                    break
                text = out.new_text
                lp = req.format_logprobs(tokenizer, out) if req.wants_logprobs else None
                if first or text or lp or out.finished:
                    yield event({**head, "choices": [req.choice(text, out.finish_reason, lp, first)]})
                    first = False
                if out.finished and req.include_usage:
                    yield event({**head, "choices": [], "usage": out.usage})
        except EngineError as e:
            yield event(engine_error(e).body())
        except Exception:  # a bug here: the client still gets an error event and [DONE]
            log.exception("stream %s failed", head["id"])
            yield event(APIError(500, "internal server error", kind="server_error", code="internal_error").body())
        yield "data: [DONE]\n\n"

    return SSEResponse(events(), run.close)


def engine_error(e: EngineError) -> APIError:
    """500 for a failure inside the engine (its cause is in the log), 503 when the server is
    shutting down, 408 for a reader too slow to keep up (streams only)."""
    status = {"shutting_down": 503, "slow_reader": 408}.get(e.code, 500)
    return APIError(status, str(e), kind="server_error", code=e.code)


def queue_timeout() -> APIError:
    return APIError(503, "the request waited longer than the queue timeout before it could be scheduled; retry "
                    "later", kind="server_error", code=QUEUE_TIMEOUT)


async def disconnected(raw: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_body(raw: Request, limit: int) -> bytes:
    """The body of a JSON request: 415 unless its Content-Type is JSON; 413 if its
    Content-Length, or what arrives of it, exceeds `limit` bytes (the rest is not read)."""
    ctype = raw.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in JSON_TYPES:
        raise APIError(415, f"Content-Type: must be application/json, got {ctype or 'none'!r}",
                       code="unsupported_media_type")
    too_big = APIError(413, f"request body: larger than the limit of {limit} bytes (see --max-body-mb)",
                       code="body_too_large")
    length = raw.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:  # h11 has checked its form
        raise too_big
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, model: type[SamplingRequest]) -> SamplingRequest:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="json_invalid") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body: must be a JSON object, got {type(data).__name__}")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        param, message = describe_validation_error(e)
        raise APIError(400, message, param) from None
    except RecursionError:
        raise APIError(400, "request body: nested too deeply") from None
    warn_ignored(request)
    return request


_warned: set[frozenset[str]] = set()


def warn_ignored(request: SamplingRequest) -> None:
    """Log the top-level fields of a request that the server does not know (served as if absent:
    a client's `temprature` gets the default temperature), as vLLM logs them: once per distinct set
    of names, each name cut short and a few named, so that a client sending new names every request
    cannot flood the log (after IGNORED_SETS sets, one last warning says so, then none)."""
    names = frozenset(request.model_extra or ())
    if not names or names in _warned or len(_warned) > IGNORED_SETS:
        return
    _warned.add(names)
    if len(_warned) > IGNORED_SETS:
        log.warning("unknown request fields: %d different sets seen, no more are logged", IGNORED_SETS)
        return
    shown = [n[:IGNORED_NAME_CHARS] + ("..." if len(n) > IGNORED_NAME_CHARS else "") for n in sorted(names)]
    more = f" and {len(shown) - IGNORED_NAMED} more" if len(shown) > IGNORED_NAMED else ""
    log.warning("request fields ignored (unknown to this server): %s%s", ", ".join(shown[:IGNORED_NAMED]), more)


def param_of(message: str, model) -> str | None:
    """The first request field a message names, if any."""
    fields = set(model.model_fields) | {"prompt"}  # the engine says "prompt" for chat messages too
    for word in re.findall(r"[A-Za-z_]+", message):
        if word in fields:
            return word
    return None
