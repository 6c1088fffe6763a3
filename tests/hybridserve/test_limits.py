"""Limits and failure behaviour of the server (issue 12): hostile sampling values, one row's
failure, request sizes, bounded stream queues, idle and slow connections, error hygiene,
content type, Host header, docs, queue timeouts. One real server (uvicorn with the
project's protocol and limits) on a loopback port for the module, the built-in model."""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import torch

from hybridserve import sampling
from hybridserve.async_engine import STOPPED, AsyncEngine, EngineError
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine
from hybridserve.guards import host_name
from hybridserve.http_server import Once, Server, _loop_exception, uvicorn_config
from hybridserve.protocol import MAX_MESSAGE
from hybridserve.sampling import Sampler, SamplingParams
from hybridserve.server import build_app
from hybridserve.server_config import ServerConfig
from tests.hybridserve.test_server import PROFILE, assert_pools_clean, fail_next_forward, on_engine

GREEDY = {"temperature": 0, "ignore_eos": True}
LIMITS = ServerConfig(max_body_mb=16 / 1024, max_connections=6, request_timeout_s=1.5,
                      chat_max_tokens=8)  # 16 KiB bodies
BACKLOG = 8
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    engine = Engine(EngineConfig.from_settings(cost_profile=str(profile), memory_gb=0.25, max_running=8,
                                               max_model_len=MAX_MODEL_LEN))
    ae = AsyncEngine(engine, threads=1, backlog=BACKLOG)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn_config(build_app(ae, LIMITS), LIMITS, "warning"), ae, grace=1)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        yield SimpleNamespace(port=port, ae=ae, engine=engine, http=client)
    server.should_exit = True
    thread.join(30)


def test_the_running_server_keeps_its_startup_heap_out_of_collections(live):
    assert gc.get_freeze_count() > 0  # hybridserve/host.py freeze_heap, at startup; unfrozen at shutdown


def wait_idle(live, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while on_engine(live, lambda e: e.has_unfinished()):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def post(live, body: dict, path="/v1/completions") -> httpx.Response:
    return live.http.post(path, json=body)


def asgi_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1),
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), *headers]}


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- 1: sampling values that overflow, one row's failure -----------------------------------


@pytest.mark.parametrize("values", [{"temperature": 1e-300}, {"temperature": 1e-39}, {"top_p": 1e-300},
                                    {"top_p": 1e-46}, {"temperature": 1e-300, "top_p": 1e-46}])
def test_sampler_takes_values_that_overflow_fp32(values):
    """Temperatures below 1e-5 are greedy and a top_p that is 0 in fp32 keeps the best token, so
    the row samples (the argmax) instead of raising, and no row is marked failed."""
    logits = torch.randn(3, 40)
    params = [SamplingParams(**{"temperature": 1.0, **values}), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0)]
    s = Sampler()
    out = s(logits, params, ["a", "b", "c"])
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == int(logits[2].argmax())
    assert s.take_failures() == {}


def test_sampler_failure_stays_in_its_row():
    """A row whose sampling raises (NaN logits) gets its argmax and is reported in failures; the
    other rows sample as they would alone."""
    logits = torch.randn(3, 40)
    bad = logits.clone()
    bad[1] = float("nan")
    p = SamplingParams(temperature=0.9, seed=3)
    alone = Sampler()(logits[2:3], [p], ["c"]).tokens[0]
    s = Sampler()
    out = s(bad, [SamplingParams(temperature=0), SamplingParams(temperature=1.0), p], ["a", "b", "c"])
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == alone
    failures = s.take_failures()
    assert list(failures) == ["b"] and isinstance(failures["b"], RuntimeError) and s.take_failures() == {}


@pytest.mark.parametrize("hostile", [{"temperature": 1e-300}, {"temperature": 1e-39}, {"top_p": 1e-300},
                                     {"top_p": 1e-46}])
def test_hostile_sampling_values_fail_nobody(live, hostile):
    """A request with an overflowing sampling value, batched with a normal one, is served (200)
    and so is the other."""
    bodies = [{"prompt": "hostile", "max_tokens": 6, "ignore_eos": True, **hostile},
              {"prompt": "bystander", "max_tokens": 12, "temperature": 0.7, "seed": 1, "ignore_eos": True}]
    with ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda b: post(live, b), bodies))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    assert [r.json()["usage"]["completion_tokens"] for r in rs] == [6, 12]


def test_sampling_failure_fails_its_request_only(live, monkeypatch):
    """When one row's sampling raises, its request gets a 500 (engine_error, no exception text)
    and the request decoding beside it in the same steps completes."""
    real = sampling.filter_logits

    def poisoned(row, top_k, top_p):
        if top_k == 7:
            raise RuntimeError("poisoned row")
        return real(row, top_k, top_p)

    monkeypatch.setattr(sampling, "filter_logits", poisoned)
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, live, {"prompt": "bystander", "max_tokens": 40, **GREEDY})
        time.sleep(0.3)  # the bystander is decoding when the poisoned request arrives
        bad = pool.submit(post, live, {"prompt": "poison", "max_tokens": 30, "top_k": 7, "ignore_eos": True})
        r_long, r_bad = long.result(), bad.result()
    assert r_long.status_code == 200 and r_long.json()["usage"]["completion_tokens"] == 40
    err = error_of(r_bad, 500)
    assert err["code"] == "engine_error" and "poison" not in err["message"]
    wait_idle(live)
    on_engine(live, assert_pools_clean)


# -- 3: request size -----------------------------------------------------------------------


def test_body_over_limit_is_refused_before_it_is_read(live):
    """A Content-Length over the limit is a 413 without the app reading a byte of the body."""
    app = build_app(live.ae, LIMITS)
    received, sent = [], []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = asgi_scope("/v1/completions", [(b"content-length", str(100 * 2**20).encode())])
    asyncio.run(app(scope, receive, send))
    assert received == [] and sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"


def test_chunked_body_over_limit_is_refused(live):
    """A body without Content-Length (chunked) is cut off at the limit with a 413."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"x" * 1024
        yield b'"}'

    r = live.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(r, 413)["code"] == "body_too_large"
    assert post(live, {"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_long_prompts_never_reach_the_engine_thread(live, monkeypatch):
    """A token-id prompt over the context is refused (400) before the engine thread sees it, and
    text is tokenized on the server's worker thread, not on the engine thread."""
    calls, threads = [], []
    real_add, real_encode = live.engine.add_request, live.engine.tokenizer.encode
    monkeypatch.setattr(live.engine, "add_request", lambda *a, **k: calls.append(1) or real_add(*a, **k))
    monkeypatch.setattr(live.engine.tokenizer, "encode",
                        lambda text: threads.append(threading.current_thread().name) or real_encode(text))
    err = error_of(post(live, {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 4}), 400)
    assert "context" in err["message"] and err["param"] == "prompt" and calls == []
    assert post(live, {"prompt": "tokenized elsewhere", "max_tokens": 2}).status_code == 200
    assert calls == [1] and threads and all(t.startswith("hybridserve-parse") for t in threads), threads


# -- 4: streams hold deltas, a reader that falls behind is cut off --------------------------


def test_unread_stream_holds_deltas_and_is_bounded(live):
    """A stream nobody reads queues per-step deltas (no accumulated ids or text), at most the
    backlog of them, then an EngineError "slow_reader"; its request is aborted and freed."""
    async def scenario():
        stream = await live.ae.add("never read " * 4, SamplingParams(max_tokens=200, **GREEDY), "unread")
        deadline = time.monotonic() + 30
        while stream.queue.qsize() <= BACKLOG and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # later outputs must be dropped, not queued
        return [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]

    items = asyncio.run(scenario())
    *outs, last = items
    assert len(outs) == BACKLOG and isinstance(last, EngineError) and last.code == "slow_reader"
    assert all(not o.finished and o.token_ids == [] and o.text == "" for o in outs)
    assert sum(len(o.new_token_ids) for o in outs) <= BACKLOG
    wait_idle(live)
    on_engine(live, assert_pools_clean)


def test_slow_stream_reader_gets_an_error_event(live):
    """A streaming client that stops reading (its writes block) has its request aborted once it
    is a backlog behind; when it reads again it finds the text so far, an error event (code
    slow_reader) and `data: [DONE]`."""
    body = json.dumps({"prompt": "slow reader", "max_tokens": 400, "stream": True, **GREEDY}).encode()

    async def scenario():
        app = build_app(live.ae, LIMITS)
        reading, sent, asked = asyncio.Event(), [], []

        async def receive():
            if not asked:
                asked.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never goes away

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and len(sent) == 3:
                await reading.wait()  # the client stops reading after its first two events

        task = asyncio.create_task(app(asgi_scope("/v1/completions", [(b"content-length", b"%d" % len(body))]),
                                       receive, send))
        deadline = time.monotonic() + 30
        await asyncio.sleep(0.2)
        while await asyncio.wrap_future(live.ae.submit(lambda e: e.has_unfinished())):
            assert time.monotonic() < deadline, "the slow reader's request was not aborted"
            await asyncio.sleep(0.05)
        reading.set()
        await asyncio.wait_for(task, 30)
        return b"".join(m.get("body", b"") for m in sent[1:]).decode()

    text = asyncio.run(scenario())
    events = [x[6:] for x in text.split("\n\n") if x]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "slow_reader"
    assert len(events) - 2 <= BACKLOG + 2  # the chunks queued before the cut, no more
    wait_idle(live)
    on_engine(live, assert_pools_clean)


# -- 5: idle and slow connections ------------------------------------------------------------


def closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_idle_and_slowloris_connections_are_closed(live):
    """A connection that sends nothing, or drips its request head a byte at a time, is closed
    once request_timeout_s has passed; a prompt client on the same server is served."""
    idle = socket.create_connection(("127.0.0.1", live.port))
    drip = socket.create_connection(("127.0.0.1", live.port))
    t0 = time.monotonic()
    drip.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed = False
    for _ in range(40):  # one header byte every 0.1 s, never the blank line
        try:
            drip.sendall(b"X")
        except OSError:
            closed = True
            break
        time.sleep(0.1)
    assert closed or closed_within(drip, 1.0), "the slow connection was left open"
    assert closed_within(idle, 2.0), "the idle connection was left open"
    assert time.monotonic() - t0 < LIMITS.request_timeout_s + 3
    assert live.http.get("/health").status_code == 200
    idle.close()
    drip.close()


def test_connections_beyond_the_cap_are_closed(live):
    """With max_connections open, one more is closed at once (well before the idle timeout of
    request_timeout_s would close it; a loaded host may take a second); once they go, requests
    are served."""
    held = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(LIMITS.max_connections)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", live.port))
    assert closed_within(extra, LIMITS.request_timeout_s - 0.5)
    for s in held + [extra]:
        s.close()
    time.sleep(0.2)
    assert live.http.get("/health").status_code == 200


def test_floods_are_logged_once(caplog):
    """Running out of descriptors (accept() failing on every retry) is one log line, not a
    traceback per retry; Once keeps a repeated condition to one line."""
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridserve"):
            for _ in range(100):
                _loop_exception(loop, {"message": "socket.accept() out of system resource",
                                       "exception": OSError(24, "Too many open files")})
    finally:
        loop.close()
    records = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None
    once = Once(every=60)
    with caplog.at_level(logging.WARNING, logger="hybridserve"):
        caplog.clear()
        for _ in range(5):
            once.warn("x %d", 1)
    assert len(caplog.records) == 1


# -- 10: error hygiene, OpenAPI --------------------------------------------------------------


def test_deeply_nested_json_is_a_400(live):
    """JSON nested past the parser's depth is a 400 json_invalid, not a 500."""
    body = b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    err = error_of(live.http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                   400)
    assert err["code"] == "json_invalid" and "deep" in err["message"]


def test_405_carries_allow(live):
    """A wrong method is a 405 whose Allow header names the right one."""
    r = live.http.get("/v1/completions")
    assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"


def test_500_does_not_echo_the_exception(live):
    """A failing forward is a 500 with a generic message; the exception text stays in the log."""
    on_engine(live, fail_next_forward("secret detail /etc/passwd"))
    err = error_of(post(live, {"prompt": "fault", "max_tokens": 4, **GREEDY}), 500)
    assert err["type"] == "server_error" and err["code"] == "engine_error" and "secret" not in err["message"]
    wait_idle(live)


@pytest.mark.parametrize("body", [{"prompt": "hi", "stop": ["", "s" * 12_000]},
                                  {"prompt": "hi", "model": "m" * 12_000},
                                  {"prompt": "hi", "temperature": -1.0, "stop": "t" * 12_000}])
def test_errors_do_not_echo_huge_values(live, body):
    """A 400 about a huge value quotes a bounded piece of it."""
    err = error_of(post(live, body), 404 if "model" in body else 400)
    assert len(err["message"]) <= MAX_MESSAGE + 100


def test_openapi_declares_bodies_and_metrics_text(live):
    """/openapi.json declares a JSON request body for both POST routes and /metrics as text."""
    doc = live.http.get("/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert "prompt" in json.dumps(doc["components"]["schemas"][model]) or path.endswith("chat/completions")
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


# -- 11: content type, Host header, docs -----------------------------------------------------


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_non_json_body_is_a_415(live, ctype):
    """A POST whose Content-Type is not JSON (what a cross-site form or fetch can send blind)
    is refused with 415 before the body is parsed."""
    headers = {"content-type": ctype} if ctype else {}
    r = live.http.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    assert error_of(r, 415)["code"] == "unsupported_media_type"


def test_host_header_is_checked(live):
    """A Host header naming another site (DNS rebinding) is a 400; the bound address and the
    loopback names, with any port, are served."""
    err = error_of(live.http.get("/v1/models", headers={"host": "attacker.example:8000"}), 400)
    assert err["code"] == "invalid_host"
    for host in ("127.0.0.1", f"127.0.0.1:{live.port}", "localhost:1", "[::1]:80"):
        assert live.http.get("/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_host_names():
    """Bound to a name: it and loopback; to 0.0.0.0: any; --allowed-hosts overrides; '*' is any."""
    assert ServerConfig().host_names == {"127.0.0.1", "localhost", "::1"}
    assert ServerConfig(host="10.1.2.3").host_names == {"10.1.2.3", "127.0.0.1", "localhost", "::1"}
    assert ServerConfig(host="0.0.0.0").host_names is None
    assert ServerConfig(host="0.0.0.0", allowed_hosts="api.example, Other.example").host_names == {
        "api.example", "other.example"}
    assert ServerConfig(allowed_hosts="*").host_names is None
    assert [host_name(h) for h in ("A.example:80", "[::1]:8000", "::1", "x")] == ["a.example", "::1", "::1", "x"]
    with pytest.raises(ValueError, match="max_body_mb"):
        ServerConfig(max_body_mb=0)


def test_docs_are_off_by_default(live):
    """/docs (a page that loads scripts from a CDN) is not served unless asked; the schema is."""
    assert live.http.get("/docs").status_code == 404 and live.http.get("/redoc").status_code == 404
    assert live.http.get("/openapi.json").status_code == 200


# -- queue timeouts (the scheduler ends such a request with finish_reason "queue_timeout") ----


def arm_queue_timeout(engine: Engine) -> None:
    """The next request that produces an output is ended as the scheduler ends one that waited
    past its queue timeout."""
    real = engine.step

    def step():
        outs = real()
        if not outs:
            return outs
        engine.step = real
        o = outs[0]
        engine.abort(o.rid)
        return [replace(o, finished=True, finish_reason="queue_timeout", new_token_ids=[], new_text="")]
    engine.step = step


def test_queue_timeout_is_a_503(live):
    """A request ended by the queue timeout is a 503 (code queue_timeout) without a stream, and an
    error event then [DONE] with one."""
    on_engine(live, arm_queue_timeout)
    err = error_of(post(live, {"prompt": "waited", "max_tokens": 4, **GREEDY}), 503)
    assert err["code"] == "queue_timeout"
    wait_idle(live)
    on_engine(live, arm_queue_timeout)
    with live.http.stream("POST", "/v1/completions", json={"prompt": "waited", "max_tokens": 4, "stream": True,
                                                           **GREEDY}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert json.loads(lines[-2][6:])["error"]["code"] == "queue_timeout" and lines[-1] == "data: [DONE]"
    assert not any('"choices"' in x for x in lines)
    wait_idle(live)
    on_engine(live, assert_pools_clean)


def test_shutdown_error_is_503():
    """The error a request gets when the engine stops under it says so (503 shutting_down)."""
    from hybridserve.server import engine_error

    err = engine_error(EngineError(STOPPED, "shutting_down"))
    assert err.status == 503 and err.code == "shutting_down"
