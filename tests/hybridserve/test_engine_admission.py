"""The engine's side of admission: max_tokens capped by the KV pool, a queue timeout reported
as a finished output, and usage's cached tokens bounded by the prompt after a retraction."""
import json

import pytest

from hybridserve import Engine
from hybridserve.sampling import SamplingParams
from tests.models import harness
from tests.models.test_kimi_linear import hf_mod as kimi_mod
from tests.models.test_kimi_linear import tiny as kimi_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    harness.save_tiny(kimi_mod.KimiLinearForCausalLM, kimi_tiny("3:1"), path)
    profile = path / "cost.json"
    profile.write_text(json.dumps({"c0": 1e-3, "c_tok": 1e-5, "c_serial": 1e-4, "c_dec": 1e-4}))
    return str(path), str(profile)


def _engine(model, **kw):
    path, profile = model
    settings = dict(dtype="float32", memory_gb=0.001, max_running=4, cost_profile=profile, page_size=16)
    return Engine(model=path, **{**settings, **kw})


def _drain(eng, steps=5000):
    outs = {}
    for _ in range(steps):
        if not eng.has_unfinished():
            break
        outs.update((o.rid, o) for o in eng.step() if o.finished)
    assert not eng.has_unfinished()
    return outs


def _all_free(eng):
    eng.scheduler.check_integrity()
    eng.scheduler.flush_cache()
    assert eng.scheduler.cache.kv_pool.num_free == eng.plan.num_pages
    assert eng.scheduler.cache.state_pool.num_free_active == eng.plan.num_active


def test_max_tokens_is_capped_by_the_kv_pool(model):
    """A request whose prompt + max_tokens exceeds what the KV pool can ever hold (far below the
    model's context here) is refused by validate() with a ValueError naming the pool's capacity
    and the largest max_tokens that would fit; one that fits exactly is accepted."""
    eng = _engine(model)
    cap = eng.scheduler.kv_capacity_tokens
    assert cap < eng.max_model_len
    ids = harness.prompt(97, 10, 1)
    with pytest.raises(ValueError, match=rf"exceeds the KV pool's capacity of {cap} tokens.*at most {cap - 10}"):
        eng.validate(ids, SamplingParams(max_tokens=cap - 9))
    assert eng.validate(ids, SamplingParams(max_tokens=cap - 10)) == ids


def test_a_small_request_is_served_beside_two_that_cannot_run_together(model):
    """Two requests that each fit the KV pool but not together, and a 4-token one behind them:
    the small one is admitted beside the first (passing the second) and finishes within a few
    steps; aborting the big ones frees everything."""
    eng = _engine(model)
    cap = eng.scheduler.kv_capacity_tokens
    big = SamplingParams(max_tokens=cap * 6 // 10, ignore_eos=True)
    bigs = [eng.add_request(harness.prompt(97, 4, i), big) for i in range(2)]  # first in every policy order
    small = eng.add_request(harness.prompt(97, 4, 9), SamplingParams(max_tokens=4, ignore_eos=True))
    done = {}
    for _ in range(20):
        done.update((o.rid, o) for o in eng.step() if o.finished)
    assert done[small].finish_reason == "length" and bigs[0] not in done
    assert eng.scheduler.waiting[0].rid == bigs[1]
    for rid in bigs:
        assert eng.abort(rid)
    assert not eng.has_unfinished()
    _all_free(eng)


def test_queue_timeout_ends_a_waiting_request_with_an_output(model):
    """A request still waiting after queue_timeout seconds (of the scheduler's clock) comes out
    of step() once, finished with finish_reason queue_timeout and no tokens; the running one
    completes and nothing leaks."""
    eng = _engine(model, max_running=1, queue_timeout=5.0)
    now = [100.0]
    eng.scheduler.clock = lambda: now[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = eng.add_request(harness.prompt(97, 30, 1), params)
    b = eng.add_request(harness.prompt(97, 30, 2), params)
    eng.step()  # a is admitted; b waits for a running slot
    now[0] += 6.0
    outs = {o.rid: o for o in eng.step()}
    assert outs[b].finished and outs[b].finish_reason == "queue_timeout"
    assert outs[b].token_ids == [] and outs[b].new_token_ids == [] and outs[b].usage["completion_tokens"] == 0
    rest = _drain(eng)
    assert b not in rest and rest[a].finish_reason == "length" and len(rest[a].token_ids) == 8
    _all_free(eng)


def test_cached_tokens_stay_within_the_prompt_after_a_retraction(model):
    """A retracted request resumes from its own prompt + output in the cache (decode states
    are checkpointed every 64 tokens, so its path keeps one after the pool takes its tail); the
    usage's cached_tokens of every request still counts prompt tokens only."""
    eng = _engine(model, policy="budget", token_budget=256, decode_reserve=0.25, memory_gb=0.0005,
                  checkpoint_interval=64, checkpoint_share=0.5)  # a plan whose KV pool forces retractions
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    rids = [eng.add_request(harness.prompt(97, n, i), params) for i, n in enumerate([20, 52, 36, 44])]
    starts = []
    run = eng.executor.run
    eng.executor.run = lambda batch: starts.extend((c.req, c.start) for c in batch.chunks) or run(batch)
    outs = _drain(eng)
    assert eng.scheduler.counters["retractions"] > 0
    assert any(start > r.prompt_len for r, start in starts)  # a retracted request resumed past its prompt
    for rid in rids:
        usage = outs[rid].usage
        assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
        assert usage["completion_tokens"] == 400
    _all_free(eng)
