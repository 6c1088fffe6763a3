"""The engine on two gloo ranks (hybridserve/parallel.py). Tensor parallel: the same greedy
tokens as one rank, through cache hits, the one budget's checkpoint pages and a host-tier
round trip (the pools' copies replayed on rank 1); aborts and a failed round free every page
and slot. Context parallel: long prefills split across the ranks, beside replicated work, give
the tokens of one rank."""
import json

import pytest
import torch

from hybridserve import Engine
from hybridserve.metrics import Metrics
from hybridserve.sampling import SamplingParams
from tests.hybridserve.test_engine_admission import _drain
from tests.models import harness
from tests.models.test_tensor_parallel import FAMILIES

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SCORED = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
FREE = {"kv_pages_held": 0, "active_slots_held": 0, "checkpoint_slots_held": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (path, cost profile)} for the tiny models of the model-level tests."""
    out = {}
    for name in ("kimi", "qwen3-next", "nemotron-h"):
        cls, cfg = FAMILIES[name]
        path = tmp_path_factory.mktemp(f"engine-tp-{name}")
        harness.save_tiny(cls, cfg(), path)
        profile = path / "cost.json"
        profile.write_text(json.dumps({"c0": 1e-3, "c_tok": 1e-5, "c_serial": 1e-4, "c_dec": 1e-4}))
        out[name] = (str(path), str(profile))
    return out


def _engine(model, **kw) -> Engine:
    path, profile = model
    settings = dict(dtype="float32", memory_gb=0.002, max_running=4, cost_profile=profile, page_size=16,
                    adaptive_threads=False)
    return Engine(model=path, **{**settings, **kw})


def _generate(eng, prompts, params=GREEDY) -> list[list[int]]:
    rids = [eng.add_request(p, params) for p in prompts]
    outs = _drain(eng)
    return [outs[r].token_ids for r in rids]


def _scored(eng, prompts) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, per prompt."""
    rids = [eng.add_request(p, SCORED) for p in prompts]
    outs = _drain(eng)
    return [(outs[r].token_ids, [lp for lp, _ in outs[r].logprobs]) for r in rids]


def _same(got, want, tol=1e-5):
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < tol


@pytest.mark.parametrize("family", ["kimi", "qwen3-next", "nemotron-h"])
def test_tp2_serves_the_tokens_of_tp1(models, family):
    """Four prompts sharing a 96-token prefix, served twice (the second time from the cache, in
    reverse order so each lands in another slot):
    TP=2's greedy tokens equal TP=1's (their logprobs within 1e-5), and the cache hit changes
    no token."""
    shared = harness.prompt(97, 96, 0)
    prompts = [shared + harness.prompt(97, 40 + 8 * i, i + 1) for i in range(4)]
    one = _engine(models[family])
    want = _scored(one, prompts)
    two = _engine(models[family], tensor_parallel_size=2)
    try:
        _same(_scored(two, prompts), want)
        hits = two.cache.stats().state_hit_tokens
        _same(_scored(two, prompts[::-1]), want[::-1])  # other slots than the first time
        assert two.cache.stats().state_hit_tokens > hits  # the resend resumed from checkpoints
        assert two.audit() == FREE
    finally:
        two.close()


def test_tp2_host_round_trip_changes_no_token(models):
    """Under the one budget with a host tier, a prompt pushed to the host by other traffic and
    loaded back (checkpoint pages, KV pages and the slot copies replayed on rank 1) gives the
    tokens of a cold one-rank run."""
    target = harness.prompt(97, 200, 0)
    cold = _generate(_engine(models["kimi"], enable_prefix_cache=False, memory_gb=0.00015, max_running=2),
                     [target])
    eng = _engine(models["kimi"], tensor_parallel_size=2, memory_gb=0.0001, max_running=2, host_memory_gb=0.01)
    try:
        assert eng.plan.unified
        assert _generate(eng, [target]) == cold
        for i in range(1, 7):
            _generate(eng, [harness.prompt(97, 200, i)])
        assert eng.cache.match_prefix(target, record_stats=False).host_len > 0
        assert _generate(eng, [target]) == cold
        assert eng.cache.stats().host_loads >= 1
        assert eng.audit() == {**FREE, "host_pages_held": 0}
    finally:
        eng.close()


def test_tp2_abort_and_failed_round_free_everything(models, monkeypatch):
    """Aborted requests free every page and slot (accounted on rank 0 for all ranks) and the
    engine goes on serving the same tokens; a round that fails stops the workers, its requests
    are failed with their memory freed, and later rounds raise a clear error."""
    prompts = [harness.prompt(97, 120, i) for i in range(3)]
    want = _generate(_engine(models["kimi"]), prompts)
    eng = _engine(models["kimi"], tensor_parallel_size=2)
    try:
        for p in prompts:
            eng.add_request(p, GREEDY)
        for _ in range(3):
            eng.step()
        for rid in list(eng.requests):
            eng.abort(rid)
        assert eng.audit() == FREE
        assert _generate(eng, prompts) == want
        eng.add_request(prompts[0], GREEDY)
        monkeypatch.setattr(eng.model, "forward", lambda batch: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
        eng.fail_inflight()
        assert eng.audit() == FREE
        assert not any(p.is_alive() for p in eng.workers.procs)
        eng.add_request(prompts[1], GREEDY)
        with pytest.raises(RuntimeError, match="workers were stopped"):
            eng.step()
    finally:
        eng.close()


@pytest.mark.parametrize("family", ["kimi", "nemotron-h"])  # Qwen3-Next's GDN: the delta rule Kimi's KDA runs
def test_cp2_serves_the_tokens_of_cp1(models, family):
    """A 100-token prompt (one replicated round), then three prompts extending it by 300 tokens
    in one round (the longest split across the ranks, attending over the first prompt's KV in
    each rank's replica; the others replicated), decode, a prompt extending a replicated one
    (split, over KV the replicated part wrote), and a resend in reverse order from the cache:
    CP=2's greedy tokens equal CP=1's, logprobs within 1e-5; /metrics counts the split rounds."""
    first = harness.prompt(97, 100, 0)
    prompts = [first] + [first + harness.prompt(97, 300, i + 1) for i in range(3)]
    longer = prompts[3] + harness.prompt(97, 300, 9)  # resumes from a prompt the split round did not split
    knobs = dict(policy="tokens", token_budget=1024)
    one = _engine(models[family], **knobs)
    want = _scored(one, prompts[:1]) + _scored(one, prompts[1:]) + _scored(one, [longer])
    two = _engine(models[family], context_parallel_size=2, **knobs)
    try:
        _same(_scored(two, prompts[:1]) + _scored(two, prompts[1:]) + _scored(two, [longer]), want)
        assert two.executor.split_rounds >= 2
        text = Metrics(two.stats).render()[0].decode()
        assert f"hybridserve_context_parallel_rounds_total {float(two.executor.split_rounds)}" in text
        _same(_scored(two, prompts[:0:-1]), want[3:0:-1])
        assert two.audit() == FREE
    finally:
        two.close()


def test_tp_settings_are_checked(models):
    """A size below 1, heads that do not split, and a missing cost profile are refused by name."""
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _engine(models["kimi"], tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cannot be split across 3 ranks"):
        _engine(models["kimi"], tensor_parallel_size=3)
    with pytest.raises(ValueError, match="cost_profile"):
        Engine(model=models["kimi"][0], dtype="float32", memory_gb=0.002, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="together are not supported"):
        _engine(models["kimi"], tensor_parallel_size=2, context_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL ranks need a device each)")
def test_tp2_on_nccl(models):
    """The CUDA path: TP=2 over NCCL (cuda:0 and cuda:1) serves the tokens of one GPU."""
    prompts = [harness.prompt(97, 150, i) for i in range(4)]
    want = _scored(_engine(models["kimi"], device="cuda"), prompts)
    eng = _engine(models["kimi"], device="cuda", tensor_parallel_size=2)
    try:
        _same(_scored(eng, prompts), want, tol=1e-3)
    finally:
        eng.close()
