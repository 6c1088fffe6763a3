"""The public API: top-level imports, LLM prompt forms and validation, one config with one
set of defaults, the API key, dtype-following state pools and start-up without calibration."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json

import pytest
import torch
from fastapi.testclient import TestClient

import hybridserve
from hybridserve import LLM, Engine, EngineConfig, SamplingParams
from hybridserve.async_engine import AsyncEngine
from hybridserve.config import OFFLINE_ROUND_TOKENS, OFFLINE_STEP
from hybridserve.server import build_app
from scheduler import SchedulerConfig
from state_cache import CacheConfig
from tests.models import harness
from tests.models.test_kimi_linear import hf_mod as kimi_mod
from tests.models.test_kimi_linear import tiny as kimi_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cost.json"
    path.write_text(json.dumps({"c0": 1e-3, "c_tok": 1e-5, "c_serial": 1e-4, "c_dec": 1e-4}))
    return str(path)


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    harness.save_tiny(kimi_mod.KimiLinearForCausalLM, kimi_tiny("3:1"), path)
    return path


def test_top_level_exports_and_version():
    """`from hybridserve import LLM, SamplingParams, Engine, EngineConfig, __version__` works and
    the version is the installed distribution's."""
    assert {"LLM", "SamplingParams", "Engine", "EngineConfig", "__version__"} <= set(hybridserve.__all__)
    assert hybridserve.__version__ == importlib.metadata.version("hybridserve")
    assert LLM.__module__ == "hybridserve.llm"


def test_generate_validates_every_prompt_before_queueing_any(profile):
    """generate([good, bad]) raises naming the bad prompt's index and queues nothing: the next
    call returns only its own outputs and nothing is left running."""
    llm = LLM(cost_profile=profile, memory_gb=0.25, max_running=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: must not be empty"):
        llm.generate(["def f():", []], GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[2\]: prompt: a dict prompt"):
        llm.generate(["a", [1, 2], {"text": "x"}], GREEDY)
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY])
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    outs = llm.generate(["x = 1"], GREEDY)
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"x = 1")


def test_offline_rounds_fill_up_to_max_step(tmp_path):
    """LLM's rounds fill up to max_step (offline nobody reads a token before its whole output),
    OFFLINE_STEP unless given, above the server's; with the server's target_step the same
    prompts take more rounds, and give the same tokens. A target or max_step given is kept."""
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"c0": 1e-3, "c_tok": 1e-4}))  # ~1,000 tokens in 0.1 s, ~5,000 in 0.5 s
    prompts = [[(7 * i + j) % 250 + 1 for j in range(600)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    runs = {}
    for name, extra in (("offline", {}), ("server", {"target_step": SchedulerConfig.target_step})):
        llm = LLM(cost_profile=str(path), memory_gb=0.25, max_running=4, **extra)
        sched = llm.engine.config.scheduler
        runs[name] = ([o.token_ids for o in llm.generate(prompts, params)], llm.engine.scheduler.counters["rounds"],
                      (sched.target_step, sched.max_step))
    assert EngineConfig().scheduler.target_step == SchedulerConfig.target_step < SchedulerConfig.max_step
    assert runs["offline"][0] == runs["server"][0]
    assert runs["offline"][1] == 2 < runs["server"][1]  # one prefill round, one decode round
    assert runs["offline"][2] == (OFFLINE_STEP, OFFLINE_STEP) and OFFLINE_STEP > SchedulerConfig.max_step
    assert LLM(cost_profile=str(path), memory_gb=0.25, max_step=0.3).engine.config.scheduler.target_step == 0.3
    given = LLM(cost_profile=str(path), memory_gb=0.25, target_step=0.05).engine.config.scheduler
    assert (given.target_step, given.max_step) == (0.05, OFFLINE_STEP)
    assert given.max_round_tokens == OFFLINE_ROUND_TOKENS and EngineConfig().scheduler.max_round_tokens is None
    capped = LLM(cost_profile=str(path), memory_gb=0.25, max_running=4, max_round_tokens=1024)
    assert [o.token_ids for o in capped.generate(prompts, params)] == runs["offline"][0]
    assert capped.engine.scheduler.counters["rounds"] >= 4  # 2,400 prompt tokens in rounds of <= 1,024, then decode


def test_vllm_prompt_forms_give_the_same_tokens(profile):
    """{"prompt": text} and {"prompt_token_ids": ids} are the text and the ids; a single prompt
    of any form returns one output; `out.outputs[0]` reads as in vLLM."""
    llm = LLM(cost_profile=profile, memory_gb=0.25, max_running=4)
    ids = list(b"import os")
    outs = llm.generate(["import os", ids, {"prompt": "import os"}, {"prompt_token_ids": ids}], GREEDY)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert all(o.prompt_token_ids == ids for o in outs)
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert one.outputs[0].token_ids == outs[0].token_ids and one.outputs[0].text == one.text
    assert one.outputs[0].finish_reason == "length"


def test_one_home_per_setting():
    """Every setting name is unique across EngineConfig, SchedulerConfig and CacheConfig, has a
    help text, and flat settings land in their section; unknown names suggest the right one."""
    settings = EngineConfig.settings()
    sections = [EngineConfig, SchedulerConfig, CacheConfig]
    own = [f.name for cls in sections for f in dataclasses.fields(cls) if f.name not in ("scheduler", "cache")]
    assert sorted(own) == sorted(settings)  # no name in two places
    assert all(f.metadata.get("help") for _, f in settings.values())
    cfg = EngineConfig.from_settings(policy="tokens", eviction="utility", memory_gb=2.0)
    assert (cfg.scheduler.policy, cfg.cache.eviction, cfg.memory_gb) == ("tokens", "utility", 2.0)
    assert cfg.replace(token_budget=128).scheduler == dataclasses.replace(cfg.scheduler, token_budget=128)
    assert EngineConfig.from_settings(**cfg.flat()) == cfg
    with pytest.raises(TypeError, match="unknown engine setting 'max_runing'; did you mean max_running"):
        EngineConfig.from_settings(max_runing=4)
    with pytest.raises(ValueError, match="policy: unknown scheduling policy 'fast'; known: .*serial"):
        EngineConfig.from_settings(policy="fast")


def test_engine_passes_built_objects_in(profile):
    """The engine builds its scheduler and cache from the config's sections (nothing is patched
    afterwards): the scheduler holds the very SchedulerConfig, the cache the CacheConfig, and
    enable_prefix_cache=False reaches the cache manager."""
    eng = Engine(cost_profile=profile, memory_gb=0.25, max_running=4, enable_prefix_cache=False, policy="budget")
    assert eng.scheduler.config is eng.config.scheduler and eng.cache.config is eng.config.cache
    assert eng.scheduler.policy.name == "budget" and not eng.scheduler.cache_manager.hits
    assert eng.scheduler.cache is eng.cache


def test_logprobs_cover_every_token_in_each_output_kind(profile):
    """With logprobs set, a whole output (LLM.generate's, each "cumulative" one, a "delta"
    stream's last) holds one (logprob, top alternatives) per token of token_ids, the same in every
    kind; each step's new_logprobs pairs with its new_token_ids, and a delta stream's new ones
    joined are the whole list; without logprobs there are none. (LLM.generate once returned the
    last token's only, and a (None, None) pair where none were asked for.)"""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    llm = LLM(cost_profile=profile, memory_gb=0.25, max_running=4)
    (out,) = llm.generate(["def f(x):"], params)
    assert len(out.token_ids) == len(out.logprobs) == 6
    assert [top[0][0] for _, top in out.logprobs] == out.token_ids  # greedy: the sampled token is the best
    assert out.outputs[0].logprobs == out.logprobs
    (plain,) = llm.generate(["def f(x):"], GREEDY)  # not asked for: none kept or returned
    assert plain.token_ids[:6] == out.token_ids and plain.logprobs == plain.new_logprobs == []
    eng = llm.engine
    for kind in ("cumulative", "delta"):
        rid = eng.add_request("def f(x):", params, outputs=kind)
        steps = [o for _ in range(50) if eng.has_unfinished() for o in eng.step() if o.rid == rid]
        assert all(len(o.new_logprobs) == len(o.new_token_ids) for o in steps)
        assert [lp for o in steps for lp in o.new_logprobs] == out.logprobs
        assert steps[-1].logprobs == out.logprobs and steps[-1].token_ids == out.token_ids
        whole = steps if kind == "cumulative" else steps[-1:]
        assert all(len(o.logprobs) == len(o.token_ids) for o in whole)
        if kind == "delta":  # a delta's outputs but its last carry no whole list
            assert all(not o.logprobs for o in steps[:-1])


def test_bf16_checkpoint_served_fp32_keeps_states_fp32_and_hits_change_nothing(kimi_path, tmp_path, profile):
    """A checkpoint declaring bfloat16 served with dtype=float32: every state slot (conv tails
    too) is fp32, and a next turn resumed from a checkpoint gives the cold run's greedy tokens
    and logprobs."""
    path = tmp_path / "bf16"
    path.mkdir()
    for f in kimi_path.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    first = harness.prompt(97, 200, 3)
    second = first + harness.prompt(97, 30, 4)
    runs = {}
    for cache_on in (True, False):
        llm = LLM(str(path), dtype="float32", memory_gb=0.05, max_running=4, page_size=16, cost_profile=profile,
                  enable_prefix_cache=cache_on)
        assert all(buf.dtype == torch.float32 for layer in llm.engine.cache.state_pool.buffers
                   for buf in layer.values())
        llm.generate([first], params)
        (out,) = llm.generate([second], params)
        runs[cache_on] = out
        assert (out.cached_tokens >= 192) == cache_on
    warm, cold = runs[True], runs[False]
    assert warm.token_ids == cold.token_ids
    lp_warm, lp_cold = [lp for lp, _ in warm.logprobs], [lp for lp, _ in cold.logprobs]
    assert max(abs(a - b) for a, b in zip(lp_warm, lp_cold)) < 1e-4


def test_no_calibration_for_policies_that_ignore_the_cost_model(kimi_path, monkeypatch):
    """A checkpoint without a cost profile on a small pool starts under `tokens` without timing
    anything; under `serial` start-up calibration fits its shapes into the pool."""
    import hybridserve.calibrate as cal

    def forbidden(*a, **k):
        raise AssertionError("calibrated although the policy never reads the cost model")

    small = dict(dtype="float32", memory_gb=5.3e-5, max_running=2, page_size=16, token_budget=64)
    with monkeypatch.context() as m:
        m.setattr(cal, "calibrate", forbidden)
        eng = Engine(model=str(kimi_path), policy="tokens", **small)
    assert eng.plan.num_pages * 16 < 128  # only one of the calibration shapes fits as it is
    eng.add_request(harness.prompt(97, 40, 1), GREEDY)
    outs = [o for _ in range(50) for o in eng.step() if o.finished]
    assert len(outs) == 1 and len(outs[0].token_ids) == GREEDY.max_tokens
    eng2 = Engine(model=str(kimi_path), policy="serial", **small)
    # fitted on timed forwards (not the coefficients' values: on a loaded machine a fit may clamp them to 0)
    assert int(eng2.scheduler.cost.meta["fitted_on"].split()[0]) > 0
    assert eng2.cache.kv_pool.num_free == eng2.plan.num_pages  # calibration gave its pages back


@pytest.mark.parametrize("key_from", ["flag", "env"])
def test_api_key_guards_v1_routes(profile, monkeypatch, capsys, key_from):
    """With an API key (flag or HYBRIDSERVE_API_KEY, which --help never prints) every /v1 route
    answers 401 in the OpenAI error shape without `Authorization: Bearer <key>` or with a wrong
    one; /health stays open."""
    from hybridserve.cli import build_parser, server_config

    if key_from == "env":
        monkeypatch.setenv("HYBRIDSERVE_API_KEY", "s3cret")
        key = server_config(build_parser().parse_args(["serve"])).api_key
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--help"])
        assert "s3cret" not in capsys.readouterr().out  # --help never prints the key
    else:
        key = server_config(build_parser().parse_args(["serve", "--api-key", "s3cret"])).api_key
    assert key == "s3cret"
    engine = AsyncEngine(Engine(cost_profile=profile, memory_gb=0.25, max_running=4))
    app = build_app(engine, api_key=key)
    body = {"prompt": "hi", "max_tokens": 2}
    with TestClient(app, base_url="http://localhost") as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.post("/v1/completions", json=body, headers=good).json()["usage"]["completion_tokens"] == 2
