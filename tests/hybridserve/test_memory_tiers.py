"""The engine's memory: one byte budget for KV and checkpoints (checkpoints stored in KV pages),
and the host tier: a prefix evicted to host memory and loaded back gives the tokens of a
cold run bit for bit, and the metrics show the bytes per tier and the host hits."""
import pytest

from hybridserve import Engine
from hybridserve.metrics import Metrics
from hybridserve.sampling import SamplingParams
from tests.hybridserve.test_engine_admission import _drain, model  # noqa: F401  (fixture)
from tests.models import harness

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model, **kw):  # noqa: F811
    path, profile = model
    settings = dict(dtype="float32", memory_gb=0.00015, max_running=2, cost_profile=profile, page_size=16,
                    adaptive_threads=False)
    return Engine(model=path, **{**settings, **kw})


def _run(eng, prompt):
    rid = eng.add_request(prompt, GREEDY)
    return _drain(eng)[rid]


def test_a_host_round_trip_changes_no_token(model):  # noqa: F811
    """A long prompt, pushed to the host tier by other traffic, is loaded back on its resend
    (KV into fresh pages, its checkpoint into the device, then into the request's slot): the
    greedy tokens equal those of an engine without a prefix cache, bit for bit."""
    target = harness.prompt(97, 200, 0)
    cold = _run(_engine(model, enable_prefix_cache=False), target).token_ids
    eng = _engine(model, host_memory_gb=0.01)
    assert eng.plan.unified and eng.plan.host_pages > 0
    assert _run(eng, target).token_ids == cold
    for i in range(1, 7):  # other prompts fill the device budget: the target's prefix moves to the host
        _run(eng, harness.prompt(97, 200, i))
    st = eng.cache.stats()
    assert st.bytes_to_host > 0 and st.host_pages_cached > 0
    assert eng.cache.match_prefix(target, record_stats=False).host_len > 0
    again = _run(eng, target)
    st = eng.cache.stats()
    assert st.host_loads >= 1 and st.host_hit_tokens > 0 and eng.scheduler.counters["host_loads"] >= 1
    assert again.usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert again.token_ids == cold
    eng.scheduler.check_integrity()
    assert eng.audit() == {"kv_pages_held": 0, "active_slots_held": 0, "checkpoint_slots_held": 0,
                           "host_pages_held": 0}


def test_one_budget_lends_checkpoint_bytes_to_kv(model):  # noqa: F811
    """Under the one budget a prompt may use every page for KV (no share is set aside for
    checkpoints), and checkpoints written later take pages back: the same memory_gb holds a
    prompt the static split cannot, and the tokens do not depend on the plan."""
    unified, split = _engine(model), _engine(model, checkpoint_share=0.5)
    assert unified.scheduler.kv_capacity_tokens > split.scheduler.kv_capacity_tokens
    long = harness.prompt(97, split.scheduler.kv_capacity_tokens, 3)
    with pytest.raises(ValueError, match="KV pool's capacity"):
        split.validate(long, GREEDY)
    out = _run(unified, long)
    assert len(out.token_ids) == 12
    short = harness.prompt(97, 150, 4)
    assert _run(unified, short).token_ids == _run(split, short).token_ids
    assert unified.cache.stats().checkpoints_cached > 0


def test_metrics_show_bytes_per_tier_and_host_hits(model):  # noqa: F811
    """/metrics: hybridserve_memory_bytes by tier and kind, and the host-tier counters."""
    eng = _engine(model, host_memory_gb=0.01)
    for i in range(6):
        _run(eng, harness.prompt(97, 200, i))
    _run(eng, harness.prompt(97, 200, 0))
    text = Metrics(eng.stats).render()[0].decode()
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("hybridserve_") and " " in line}
    st = eng.cache.stats()
    assert series['hybridserve_memory_bytes{kind="checkpoint",tier="host"}'] == \
        st.host_checkpoints_cached * st.checkpoint_bytes
    assert series['hybridserve_memory_bytes{kind="kv",tier="host"}'] == st.host_pages_cached * st.page_bytes
    assert series['hybridserve_memory_bytes{kind="checkpoint",tier="device"}'] == \
        st.checkpoints_used * st.checkpoint_bytes > 0
    assert series["hybridserve_host_hit_tokens_total"] == st.host_hit_tokens > 0
    assert series["hybridserve_host_bytes_written_total"] == st.bytes_to_host > 0
    rates = {k: series[f'hybridserve_checkpoint_resume_rate{{kind="{k}"}}'] for k in eng.cache.kind_rates.snapshot()}
    assert rates == eng.cache.kind_rates.snapshot()
    assert rates["last"] == (1 + 1) / (6 + 1)  # six prompts wrote one each; the repeated one resumed from its own


def test_memory_settings_are_checked():
    """A host tier needs the one budget; negative or zero sizes are refused, naming the field."""
    from hybridserve import EngineConfig

    with pytest.raises(ValueError, match="host_memory_gb: a host tier needs the one budget"):
        EngineConfig.from_settings(host_memory_gb=1.0, checkpoint_share=0.5)
    with pytest.raises(ValueError, match="host_memory_gb must be >= 0"):
        EngineConfig.from_settings(host_memory_gb=-1.0)
    with pytest.raises(ValueError, match="staging_rows must be >= 1"):
        EngineConfig.from_settings(staging_rows=0)
    assert EngineConfig().checkpoint_share is None and EngineConfig().host_memory_gb == 0
