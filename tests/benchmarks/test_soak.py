"""The soak, short: the real server under hostile, leaving and never-reading clients, a burst
over its pool and SIGTERM with requests in flight (benchmarks/soak.py); and the verdicts its
clients give, on canned responses."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.soak import Soak, run
from benchmarks.soak_clients import Plan, Workload, run_one

SHORT = Soak(requests=90, concurrency=12, burst_every=45, burst_size=10, whales=0, in_flight=4, hang_s=40,
             queue_timeout_s=20, server_args=("--shutdown-grace-s", "2"))
ERROR = {"error": {"message": "m", "type": "invalid_request_error", "param": "n", "code": None}}


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


CHUNK = {"choices": [{"text": "a", "finish_reason": None}]}
LAST = {"choices": [{"text": "b", "finish_reason": "length"}]}
CANNED = [  # (stream, status, content type, body, end, detail)
    (False, 200, "application/json", json.dumps({"choices": [{"finish_reason": "stop"}]}).encode(), "complete", "stop"),
    (False, 400, "application/json", json.dumps(ERROR).encode(), "error", "400 invalid_request_error (n)"),
    (False, 500, "text/plain", b"Internal Server Error", "lost", "HTTP 500 whose body is not JSON"),
    (False, 503, "application/json", b'{"detail": "busy"}', "lost", "HTTP 503 not in the OpenAI error shape"),
    (False, 200, "application/json", json.dumps({"choices": [{"finish_reason": "abort"}]}).encode(), "lost",
     "HTTP 200 with finish_reason=abort"),
    (True, 200, "text/event-stream", sse(CHUNK, LAST, b"[DONE]"), "complete", "length"),
    (True, 200, "text/event-stream", sse(CHUNK, {"error": {**ERROR["error"], "type": "server_error",
                                                           "code": "shutting_down"}}, b"[DONE]"),
     "error", "stream server_error shutting_down"),
    (True, 200, "text/event-stream", sse(CHUNK), "lost", "stream cut before [DONE]"),
    (True, 200, "text/event-stream", sse(CHUNK, b"[DONE]"), "lost", "[DONE] after finish_reason=None"),
    (True, 200, "text/event-stream", sse(CHUNK, b"{not json"), "lost", "a stream event that is not JSON"),
]


@pytest.mark.parametrize("stream, status, ctype, body, end, detail", CANNED)
def test_verdicts_on_canned_responses(stream, status, ctype, body, end, detail):
    """A reading client's request is complete only with finish_reason stop or length, an explicit
    error only as an OpenAI-shaped body or a stream error event followed by [DONE]; anything
    else (a non-JSON or other-shaped error, a cut stream, no finish_reason, abort) is lost."""
    transport = httpx.MockTransport(lambda _: httpx.Response(status, content=body,
                                                             headers={"content-type": ctype}))
    plan = Plan(0, "/v1/completions", {"prompt": "x", "stream": stream})

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://soak") as http:
            return await run_one(http, plan)

    got = asyncio.run(go())
    assert (got.end, got.detail) == (end, detail)


def test_plans_are_seeded():
    """The same seed draws the same plans; another seed draws others."""
    def draw(seed):
        return Workload(seed, 3072).plans(200, 50, 8, 2)

    assert draw(1) == draw(1) and draw(1) != draw(2)
    plans = draw(1)
    assert len(plans) == 200 + 3 * 8 and sum(p.whale for p in plans) == 2


def test_short_soak_loses_and_leaks_nothing(tmp_path):
    """Every request ends complete or with an explicit error (none hangs or ends silently, the
    ones in flight at SIGTERM included), the server exits on SIGTERM, and once idle it holds
    no page or slot outside its prefix cache, can hand its whole pool to one prompt, and
    --debug-integrity found nothing."""
    s = run(SHORT, tmp_path / "soak.json")
    assert s["lost"] == 0, (s["lost_by_reason"], s["lost_examples"])
    assert s["leaks"] == 0, s["leak_check"]
    assert s["shutdown"]["exit_status"] is not None, s["shutdown"]
    assert s["completions"] and s["aborts"] and s["errors"], s  # the mix reached every end
