"""The debug audit: with --debug-integrity, POST /debug/audit flushes the cache when idle,
checks every pool and counts what is still held (a leak detector usable from outside)."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hybridserve.async_engine import AsyncEngine
from hybridserve.engine import Engine
from hybridserve.server import build_app
from tests.hybridserve.test_server import PROFILE


@pytest.fixture()
def profile(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def test_engine_audit_counts_what_a_leak_holds(profile):
    engine = Engine(cost_profile=profile, memory_gb=0.25, max_running=4, max_model_len=256)
    engine.add_request(list(range(1, 150)), rid="a")
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.stats().checkpoints_cached > 0  # the flush has something to drop
    assert engine.audit() == {"kv_pages_held": 0, "active_slots_held": 0, "checkpoint_slots_held": 0}
    leaked = engine.cache.kv_pool.alloc(2)  # what a lost request would hold
    assert engine.audit()["kv_pages_held"] == 2
    engine.cache.kv_pool.free(leaked)
    engine.add_request([1, 2, 3], rid="b")
    with pytest.raises(RuntimeError, match="idle"):
        engine.audit()


@pytest.mark.parametrize("debug", [False, True])
def test_audit_route_only_with_debug_integrity(profile, debug):
    engine = AsyncEngine(Engine(cost_profile=profile, memory_gb=0.25, max_running=4, max_model_len=256,
                                debug_integrity=debug), threads=1)
    with TestClient(build_app(engine, api_key="k"), base_url="http://localhost") as client:
        auth = {"Authorization": "Bearer k"}
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 3}, headers=auth)
        assert r.status_code == 200
        assert client.post("/debug/audit").status_code == 401  # behind the key like /v1
        r = client.post("/debug/audit", headers=auth)
        if not debug:
            assert r.status_code == 404
            return
        assert r.status_code == 200, r.text
        assert r.json() == {"kv_pages_held": 0, "active_slots_held": 0, "checkpoint_slots_held": 0}
