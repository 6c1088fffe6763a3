"""Schema fuzzing: schemathesis generates requests from the app's own /openapi.json (valid
and invalid bodies for both POST routes, the GET routes) and calls the app in-process; no
response may be a 5xx, and each must match the status codes, content types and schemas the
document declares. The engine is the built-in model with a short context, so that accepted
requests stay cheap; the cases are bounded (CASES per POST route and mode)."""
from __future__ import annotations

import json
import time

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from hybridserve.async_engine import AsyncEngine
from hybridserve.engine import Engine
from hybridserve.server import build_app
from tests.hybridserve.test_server import PROFILE, assert_pools_clean

CASES = 100  # per POST route and generation mode: 400 in all, plus one for each GET route
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
RUNS = [("POST /v1/completions", "positive"), ("POST /v1/completions", "negative"),
        ("POST /v1/chat/completions", "positive"), ("POST /v1/chat/completions", "negative"),
        ("GET /v1/models", "positive"), ("GET /health", "positive"), ("GET /metrics", "positive")]


def fuzz(operation, mode: str) -> int:
    """Run up to CASES generated cases of one operation through the checks; how many ran."""
    seen = []

    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        seen.append(case)
        case.call_and_validate(checks=CHECKS)

    run()
    return len(seen)


def test_api_conforms_to_its_schema(tmp_path):
    """Requests generated from the schema (valid ones, and invalid ones for the POST bodies) all
    get a non-5xx answer that conforms to the declared schema; afterwards the engine is idle
    and its pools are whole. (One test: schemathesis ends the app's lifespan, and so the
    engine, when the test that started it ends.)"""
    profile = tmp_path / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    engine = AsyncEngine(Engine(cost_profile=str(profile), memory_gb=0.25, max_running=4, max_model_len=24),
                         threads=1)
    app = build_app(engine, allowed_hosts="testserver", chat_max_tokens=4)  # schemathesis sends Host: testserver
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = {r.ok().label: r.ok() for r in schema.get_all_operations()}
    assert {label for label, _ in RUNS} == set(operations)
    counts = {f"{label} {mode}": fuzz(operations[label], mode) for label, mode in RUNS}
    print("fuzz cases:", sum(counts.values()), counts)
    assert all(n >= CASES for run, n in counts.items() if run.startswith("POST")), counts
    deadline = time.monotonic() + 30
    while engine.submit(lambda e: e.has_unfinished()).result(30):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine.submit(assert_pools_clean).result(30)
