"""The OpenAI-compatible server end to end: real HTTP against uvicorn on a loopback port,
the built-in model behind it (one server for the module)."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hybridserve.async_engine import AsyncEngine
from hybridserve.config import EngineConfig
from hybridserve.engine import Engine
from hybridserve.server import build_app

PROFILE = {"c0": 0.01, "c_tok": 1e-4, "c_serial": 1e-3, "c_dec": 1e-3}
GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    engine = Engine(EngineConfig.from_settings(cost_profile=str(profile), memory_gb=0.25, max_running=12))
    ae = AsyncEngine(engine, threads=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(ae), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with httpx.Client(base_url=url, timeout=60) as client:
        yield SimpleNamespace(url=url, ae=ae, engine=engine, http=client)
    server.should_exit = True
    thread.join(30)
    assert not ae.alive


def complete(srv, prompt, **kw) -> dict:
    r = srv.http.post("/v1/completions", json={"prompt": prompt, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def stream(srv, path: str, body: dict) -> list[dict]:
    """The parsed `data:` chunks of an SSE response (checks it ends with [DONE])."""
    with srv.http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in lines[:-1]]


def on_engine(srv, fn, timeout=30):
    return srv.ae.submit(fn).result(timeout)


def wait_idle(srv, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while on_engine(srv, lambda e: e.has_unfinished()):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def assert_pools_clean(engine: Engine) -> None:
    """Integrity holds, nothing runs, and after a flush every page and slot is free."""
    s = engine.scheduler
    s.check_integrity()
    assert not s.running and not s.waiting and not s.inflight and not engine.requests
    s.flush_cache()
    st = s.cache_stats()
    assert (st.pages_free, st.checkpoints_free, st.active_free) == (st.pages_total, st.checkpoints_total,
                                                                     st.active_total)


# -- happy paths -------------------------------------------------------------------------


def test_completion_shape_and_usage(srv):
    """A completion has the OpenAI shape; prompt tokens = encoded length, completion tokens = max_tokens."""
    prompt = "The capital of France is"
    out = complete(srv, prompt, max_tokens=7, model="builtin", **GREEDY)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == "builtin"
    assert isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    n = len(prompt.encode())
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7,
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_stream_equals_non_stream(srv):
    """Streamed text deltas concatenate to the non-stream text; include_usage adds a usage-only last chunk."""
    body = {"prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    full = complete(srv, **body)
    chunks = stream(srv, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *text_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert {c["id"] for c in chunks} == {usage["id"]} and usage["id"].startswith("cmpl-")
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])


def test_token_id_prompt_equals_text_prompt(srv):
    """A prompt given as token ids gives the same greedy completion as the same prompt as text."""
    text = "token ids or text"
    a = complete(srv, text, max_tokens=6, **GREEDY)
    b = complete(srv, list(text.encode()), max_tokens=6, **GREEDY)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]


def test_chat_stream_and_non_stream(srv):
    """Chat: the message and the streamed deltas agree; prompt tokens = the chat template's length."""
    body = {"messages": CHAT, "max_completion_tokens": 9, **GREEDY}
    full = srv.http.post("/v1/chat/completions", json=body).json()
    assert full["id"].startswith("chatcmpl-") and full["object"] == "chat.completion"
    msg = full["choices"][0]["message"]
    assert msg["role"] == "assistant" and full["choices"][0]["finish_reason"] == "length"
    template = srv.engine.tokenizer.apply_chat_template(CHAT)
    assert full["usage"]["prompt_tokens"] == len(template.encode()) and full["usage"]["completion_tokens"] == 9
    chunks = stream(srv, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    *deltas, usage = chunks
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in deltas) == msg["content"]
    assert deltas[-1]["choices"][0]["finish_reason"] == "length" and usage["usage"] == full["usage"]


def test_logprobs(srv):
    """logprobs=k returns one logprob per token and k alternatives, the sampled one the best under greedy."""
    out = complete(srv, "log probabilities", max_tokens=5, logprobs=3, **GREEDY)["choices"][0]["logprobs"]
    assert len(out["tokens"]) == len(out["token_logprobs"]) == len(out["top_logprobs"]) == 5
    for lp, top in zip(out["token_logprobs"], out["top_logprobs"]):
        assert lp <= 0 and 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp)
    chat = srv.http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "logprobs": True,
                                                       "top_logprobs": 2, **GREEDY}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["logprob"] == pytest.approx(c["top_logprobs"][0]["logprob"]) for c in content)


def test_stop_string(srv):
    """A stop string taken from a previous greedy output ends the text right before it, finish_reason stop."""
    body = {"prompt": "stop strings", "max_tokens": 32, **GREEDY}
    text = complete(srv, **body)["choices"][0]["text"]
    candidates = [text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2]]
    assert candidates, f"no usable stop string in {text!r}"
    stop = candidates[len(candidates) // 2]
    want = text[:text.find(stop)]
    out = complete(srv, **body, stop=[stop, "never appears \u2603"])["choices"][0]
    assert out["text"] == want and out["finish_reason"] == "stop"
    chunks = stream(srv, "/v1/completions", {**body, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_concurrent_clients_equal_solo(srv):
    """8 clients at once get, token for token, what each got alone (greedy)."""
    bodies = [{"prompt": f"client {i}: " + "x" * (7 * i), "max_tokens": 6 + i, **GREEDY} for i in range(8)]
    solo = [complete(srv, **b)["choices"][0]["text"] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: complete(srv, **b)["choices"][0]["text"], bodies))
    assert together == solo


def test_openai_client(srv):
    """The `openai` client works for completions and chat, stream and not, and agrees with itself."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    c = client.completions.create(model=model, prompt="openai client", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    parts = client.completions.create(model=model, prompt="openai client", max_tokens=8, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in parts if p.choices) == c.choices[0].text
    chat = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    parts = list(client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert parts[-1].usage.total_tokens == chat.usage.total_tokens
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", temperature=-3)


def test_models_and_health(srv):
    """/v1/models lists the served model and /health answers ok."""
    models = srv.http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["builtin"]
    assert srv.http.get("/health").json() == {"status": "ok"}


def test_metrics_series_and_state_hits(srv):
    """/metrics exposes latency, queue, pool and token series; a repeated long prompt shows up as KV and
    state hits there and as cached_tokens in usage."""
    prompt = "shared prefix " * 20  # 280 tokens: checkpoints at 64, 128, 192, 256
    first = complete(srv, prompt, max_tokens=2, **GREEDY)
    before = scrape(srv)
    second = complete(srv, prompt, max_tokens=2, **GREEDY)
    after = scrape(srv)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 256 and cached % 64 == 0
    assert after["hybridserve_state_hit_tokens_total"] - before["hybridserve_state_hit_tokens_total"] == cached
    assert after["hybridserve_kv_hit_tokens_total"] - before["hybridserve_kv_hit_tokens_total"] >= cached
    assert after["hybridserve_prompt_tokens_total"] - before["hybridserve_prompt_tokens_total"] == len(prompt)
    assert after["hybridserve_decode_tokens_total"] > before["hybridserve_decode_tokens_total"]
    ttft = "hybridserve_time_to_first_token_seconds_count"
    assert after[ttft] > before[ttft]
    for name in ("hybridserve_inter_token_latency_seconds_count", "hybridserve_e2e_request_latency_seconds_count",
                 "hybridserve_prefill_tokens_total", "hybridserve_cache_lookup_tokens_total"):
        assert after[name] > 0, name
    for name in ("hybridserve_requests_waiting", "hybridserve_requests_running", "hybridserve_kv_pages_used",
                 "hybridserve_checkpoint_slots_used", "hybridserve_active_slots_used", "hybridserve_kv_hit_rate",
                 "hybridserve_state_hit_rate"):
        assert name in after, name
    assert after["hybridserve_kv_pages_total"] > 0 and after["hybridserve_checkpoint_slots_total"] > 0
    assert after['hybridserve_requests_total{finish_reason="length"}'] >= 2


def scrape(srv) -> dict[str, float]:
    r = srv.http.get("/metrics")
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


# -- bad input ---------------------------------------------------------------------------

ERRORS = [  # (path, raw body, status, words the message must hold, param)
    ("/v1/completions", b'{"prompt": "hi", ', 400, ["JSON"], None),
    ("/v1/completions", b'["not", "an", "object"]', 400, ["JSON object"], None),
    ("/v1/completions", b'{"max_tokens": 4}', 400, ["prompt", "required"], "prompt"),
    ("/v1/completions", {"prompt": 12}, 400, ["prompt"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, ["max_tokens", "integer"], "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, ["stream"], "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, 400, ["stop"], "stop"),
    ("/v1/completions", {"prompt": ""}, 400, ["prompt", "empty"], "prompt"),
    ("/v1/completions", {"prompt": []}, 400, ["prompt", "empty"], "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, ["prompt", "100000"], "prompt"),
    ("/v1/completions", {"prompt": [5, -1]}, 400, ["prompt", "-1"], "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, ["prompt", "one prompt"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5_000_000}, 400, ["max_tokens", "context"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 500_000}, 400, ["capacity"], "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, ["temperature"], "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e30}, 400, ["temperature"], "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, ["temperature"], "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, ["top_p"], "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -7}, 400, ["top_k"], "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, ["seed"], "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400, ["logprobs"], "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400, ["n=1"], "n"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, ["echo"], "echo"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 1.0}, 400, ["presence_penalty"], "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, ["gpt-4o", "builtin"], "model"),
    ("/v1/chat/completions", {"messages": []}, 400, ["messages", "empty"], "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, ["messages.0.role"], "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, ["messages.0.content"],
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     ["text"], "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -2}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, ["logprobs"], "top_logprobs"),
]


@pytest.mark.parametrize("path,body,status,words,param", ERRORS, ids=[f"{i}" for i in range(len(ERRORS))])
def test_bad_input_gets_openai_error(srv, path, body, status, words, param):
    """Bad input gets a 4xx in the OpenAI error shape naming the problem, and the server keeps serving."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    variants = [content] if isinstance(body, bytes) or "stream" in body else \
        [content, json.dumps({**body, "stream": True}).encode()]
    for data in variants:
        r = srv.http.post(path, content=data, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert all(w in err["message"] for w in words), err["message"]
        assert err["param"] == param
    assert complete(srv, "still serving", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_unknown_request_fields_are_served_and_logged_once_per_set(srv, caplog, monkeypatch):
    """A request with a field the server does not know (a typo) is served as if the field were absent,
    and the log names it once per distinct set of such fields (names cut short, a few named); past
    IGNORED_SETS sets one last warning says so and no more follow."""
    from hybridserve import server

    monkeypatch.setattr(server, "_warned", set())
    monkeypatch.setattr(server, "IGNORED_SETS", 3)
    warned = lambda: [r.getMessage() for r in caplog.records if r.name == server.log.name]  # noqa: E731
    with caplog.at_level("WARNING", logger=server.log.name):
        plain = complete(srv, "hello", max_tokens=3, temperature=0)
        assert complete(srv, "hello", max_tokens=3, temperature=0, temprature=0.9)["choices"] == plain["choices"]
        assert warned() == ["request fields ignored (unknown to this server): temprature"]
        complete(srv, "hello", max_tokens=3, temperature=0, temprature=0.9)  # the same set: not again
        complete(srv, "hello", max_tokens=3)
        assert len(warned()) == 1
        complete(srv, "hello", max_tokens=3, **{"a" * 100: 1}, **{f"f{i}": i for i in range(9)})
        assert warned()[-1] == (f"request fields ignored (unknown to this server): {'a' * 40}..., f0, f1, f2, f3, "
                                "f4, f5, f6 and 2 more")
        complete(srv, "hello", max_tokens=3, seed_typo=1)
        complete(srv, "hello", max_tokens=3, another=1)
        complete(srv, "hello", max_tokens=3, yet_another=1)
        assert warned()[-2:] == ["request fields ignored (unknown to this server): seed_typo",
                                 "unknown request fields: 3 different sets seen, no more are logged"]
        assert len(warned()) == 4


def test_unknown_route_and_method(srv):
    """Unknown routes and methods answer 404 / 405 in the OpenAI error shape."""
    r = srv.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = srv.http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_hf_chat_template_adds_special_tokens_once():
    """With a transformers tokenizer the chat prompt is the template's tokens, BOS once; a template
    that raises is a ValueError naming messages."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from hybridserve.protocol import ChatRequest

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "user": 3, ":": 4, "hi": 5, "assistant": 6, "there": 7}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('system messages are not allowed') }}{% endif %}"
                         "{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant : {% endif %}")
    ids = ChatRequest(messages=[{"role": "user", "content": "hi there"}]).engine_prompt(tok)
    assert ids == [0, 3, 4, 5, 7, 6, 4]
    with pytest.raises(ValueError, match="messages: .*system messages are not allowed"):
        ChatRequest(messages=[{"role": "system", "content": "x"}]).engine_prompt(tok)


# -- failures and disconnects ------------------------------------------------------------


@pytest.mark.parametrize("streaming", [True, False])
def test_disconnect_aborts_and_frees(srv, streaming):
    """A client that goes away mid-request aborts it: the engine goes idle, pools pass integrity and,
    once the cache is flushed, every page and slot is free."""
    body = {"prompt": "a long answer " * 12, "max_tokens": 20_000, **GREEDY}
    aborted = scrape(srv).get('hybridserve_requests_total{finish_reason="abort"}', 0)
    if streaming:
        with srv.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: {") for x in got)
    else:
        with pytest.raises(httpx.ReadTimeout):
            srv.http.post("/v1/completions", json=body, timeout=0.5)
    wait_idle(srv)  # 20k tokens would take minutes if the request were still running
    on_engine(srv, assert_pools_clean)
    assert scrape(srv)['hybridserve_requests_total{finish_reason="abort"}'] == aborted + 1


def fail_next_forward(message: str):
    """A function to run on the engine thread: the next forward raises RuntimeError(message)."""
    def arm(engine):
        real = engine.executor.run

        def broken(batch):
            engine.executor.run = real
            raise RuntimeError(message)
        engine.executor.run = broken
    return arm


def test_failing_step_fails_its_batch_only(srv):
    """A forward that raises fails the requests of its batch (5xx, server_error, no exception
    text) and frees them; the next requests are served normally."""
    on_engine(srv, fail_next_forward("injected fault"))
    r = srv.http.post("/v1/completions", json={"prompt": "fault", "max_tokens": 4, **GREEDY})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected fault" not in r.json()["error"]["message"]  # the cause is logged, not echoed
    wait_idle(srv)
    on_engine(srv, assert_pools_clean)
    assert complete(srv, "after the fault", max_tokens=3, **GREEDY)["usage"]["completion_tokens"] == 3
    on_engine(srv, fail_next_forward("injected fault"))
    chunks = stream(srv, "/v1/completions", {"prompt": "fault in a stream", "max_tokens": 4, **GREEDY})
    assert chunks[-1]["error"]["type"] == "server_error"
    assert srv.http.get("/health").status_code == 200


def test_build_makes_the_engine_on_the_thread_that_steps_it(tmp_path):
    """AsyncEngine.build runs the engine's construction (weights, kernels: parallel torch work)
    on the engine thread, the thread that later steps it, so the process has one OpenMP team."""
    profile = tmp_path / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    made_on = []

    def make():
        made_on.append(threading.get_ident())
        return Engine(EngineConfig.from_settings(cost_profile=str(profile), memory_gb=0.25, max_running=2))

    ae = AsyncEngine.build(make, threads=1)
    try:
        assert ae.alive and made_on and made_on[0] != threading.get_ident()
        assert ae.submit(lambda e: threading.get_ident()).result(30) == made_on[0]
        assert ae.submit(lambda e: __import__("torch").get_num_threads()).result(30) == 1

        async def one():
            from hybridserve.sampling import SamplingParams
            outs = [o async for o in await ae.add([1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))]
            return outs[-1]

        import asyncio
        last = asyncio.run(one())
        assert last.finished and len(last.token_ids) == 3
    finally:
        ae.shutdown()
    assert not ae.alive


def test_build_raises_what_make_raises_and_leaves_no_thread():
    def make():
        raise ValueError("no such model")

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(make)
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
