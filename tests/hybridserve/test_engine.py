import json

import pytest
import torch

from hybridserve import LLM, Engine
from hybridserve.sampling import SamplingParams
from models.batch import ForwardBatch
from models.builtin import ByteTokenizer
from scheduler import CostModel
from tests.models import harness
from tests.models.test_kimi_linear import hf_mod as kimi_mod
from tests.models.test_kimi_linear import tiny as kimi_tiny
from tests.models.test_qwen3_next import hf_mod as qwen_mod
from tests.models.test_qwen3_next import tiny as qwen_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "cost.json"
    path.write_text(json.dumps({"c0": 1e-3, "c_tok": 1e-5, "c_serial": 1e-4, "c_dec": 1e-4}))
    return str(path)


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3_next"])
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_linear":
        ref = harness.save_tiny(kimi_mod.KimiLinearForCausalLM, kimi_tiny("3:1"), path)
    else:
        ref = harness.save_tiny(qwen_mod.Qwen3NextForCausalLM, qwen_tiny("3:1-gqa2"), path)
    return ref, str(path)


def _hf_greedy(ref, ids, n):
    with torch.no_grad():
        # an explicit mask: without one, generate() takes every pad_token_id in the prompt for padding
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _engine(path, profile, **kw):
    return Engine(model=path, dtype="float32", memory_gb=0.05, max_running=8, cost_profile=profile,
                  page_size=16, **kw)


def test_continuous_batching_matches_transformers(tiny_model, profile):
    """Requests of different lengths arriving at different steps get exactly transformers'
    greedy tokens (continuous batching, chunked prefill and mixed batches change nothing)."""
    ref, path = tiny_model
    eng = _engine(path, profile, policy="budget", token_budget=64)
    vocab = ref.config.vocab_size
    prompts = [harness.prompt(vocab, n, seed) for seed, n in enumerate([150, 37, 90, 5])]
    arrive = {0: [0], 2: [1], 3: [2], 6: [3]}  # step -> requests arriving before it
    got, step = {}, 0
    while len(got) < len(prompts):
        for i in arrive.get(step, []):
            eng.add_request(prompts[i], GREEDY, rid=str(i))
        for o in eng.step():
            if o.finished:
                got[int(o.rid)] = o.token_ids
        step += 1
        assert step < 500
    for i, p in enumerate(prompts):
        assert got[i] == _hf_greedy(ref, p, GREEDY.max_tokens), f"request {i}"
    eng.scheduler.check_integrity()


@pytest.mark.warmup
def test_warm_up_runs_the_largest_round_first_and_leaves_no_trace(tiny_model, profile):
    """At start-up the engine runs one forward of its policy's largest round (most_tokens: here
    max_round_tokens=512, as 8 prompts of 64, one per active slot) before any request. Every
    page and slot is free afterwards and greedy tokens are still transformers' (the warm-up's
    garbage states and KV are never read). With warmup off no forward runs at start."""
    ref, path = tiny_model
    forwards = []

    def record(module, args):  # every module given a batch sees it (the model and its backbone): once per batch
        if args and isinstance(args[0], ForwardBatch) and all(b is not args[0] for b, _ in forwards):
            forwards.append((args[0], (args[0].num_tokens, len(args[0].segments))))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        for warm in (True, False):
            forwards.clear()
            eng = _engine(path, profile, max_round_tokens=512, warmup=warm)
            started = [size for _, size in forwards]
            assert started == ([(512, 8)] if warm else [])
            assert eng.audit() == {"kv_pages_held": 0, "active_slots_held": 0, "checkpoint_slots_held": 0}
            prompts = [harness.prompt(ref.config.vocab_size, n, seed) for seed, n in enumerate([150, 37, 64])]
            rids = [eng.add_request(p, GREEDY) for p in prompts]
            got = {}
            while eng.has_unfinished():
                got.update((o.rid, o.token_ids) for o in eng.step() if o.finished)
            for rid, p in zip(rids, prompts):
                assert got[rid] == _hf_greedy(ref, p, GREEDY.max_tokens), (warm, rid)
    finally:
        hook.remove()


def test_shared_prefix_hits_state_cache_and_keeps_tokens(tiny_model, profile):
    """A second wave sharing a 128-token prefix resumes from checkpoints (state-hit tokens > 0)
    and yields the same greedy tokens as an engine with the prefix cache off."""
    ref, path = tiny_model
    vocab = ref.config.vocab_size
    prefix = harness.prompt(vocab, 128, 99)
    wave1 = [prefix + harness.prompt(vocab, 20, i) for i in range(3)]
    wave2 = [prefix + harness.prompt(vocab, 30, 10 + i) for i in range(3)]
    outs = {}
    for cache_on in (True, False):
        llm = LLM(path, dtype="float32", memory_gb=0.05, max_running=8, cost_profile=profile, page_size=16,
                  enable_prefix_cache=cache_on)
        llm.generate(wave1, GREEDY)
        before = llm.engine.stats()["cache"]["state_hit_tokens"]
        outs[cache_on] = [o.token_ids for o in llm.generate(wave2, GREEDY)]
        hits = llm.engine.stats()["cache"]["state_hit_tokens"] - before
        assert (hits >= 3 * 128) if cache_on else (hits == 0)
        llm.engine.scheduler.check_integrity()
    assert outs[True] == outs[False]


def test_bf16_states_take_half_the_bytes_and_checkpoint_hits_keep_tokens(tiny_model, profile):
    """state_dtype="bfloat16": the recurrent states and their checkpoints are kept in bf16 (the
    conv tails in the model's dtype), so a slot takes fewer bytes; a second wave resuming from bf16
    checkpoints gives the greedy tokens of an engine with the prefix cache off."""
    ref, path = tiny_model
    vocab = ref.config.vocab_size
    prefix = harness.prompt(vocab, 128, 5)
    wave1 = [prefix + harness.prompt(vocab, 20, 40 + i) for i in range(3)]
    wave2 = [prefix + harness.prompt(vocab, 30, 50 + i) for i in range(3)]
    outs, slot_bytes = {}, {}
    for state_dtype, cache_on in (("bfloat16", True), ("bfloat16", False), ("float32", False)):
        llm = LLM(path, dtype="float32", memory_gb=0.05, max_running=8, cost_profile=profile, page_size=16,
                  enable_prefix_cache=cache_on, state_dtype=state_dtype)
        pool = llm.engine.cache.state_pool
        assert {b["recurrent"].dtype for b in pool.buffers} == {getattr(torch, state_dtype)}
        assert {b["conv"].dtype for b in pool.buffers} == {torch.float32}
        slot_bytes[state_dtype] = pool.bytes_per_slot
        llm.generate(wave1, GREEDY)
        before = llm.engine.stats()["cache"]["state_hit_tokens"]
        outs[state_dtype, cache_on] = [o.token_ids for o in llm.generate(wave2, GREEDY)]
        hits = llm.engine.stats()["cache"]["state_hit_tokens"] - before
        assert (hits >= 3 * 128) if cache_on else (hits == 0)
        llm.engine.scheduler.check_integrity()
    assert outs["bfloat16", True] == outs["bfloat16", False]
    conv = sum(b["conv"][0].numel() * 4 for b in pool.buffers)
    assert slot_bytes["bfloat16"] - conv == (slot_bytes["float32"] - conv) // 2


def test_a_burst_with_one_system_prompt_computes_it_once_and_keeps_tokens(tiny_model, profile):
    """Requests submitted together with a shared 150-token prefix: all but one wait while it
    computes the prefix, resume from its checkpoint at 128, and give the tokens of an engine
    with the prefix cache off."""
    ref, path = tiny_model
    vocab = ref.config.vocab_size
    prefix = harness.prompt(vocab, 150, 7)
    burst = [prefix + harness.prompt(vocab, 20, 30 + i) for i in range(4)]
    outs, stats = {}, {}
    for cache_on in (True, False):
        llm = LLM(path, dtype="float32", memory_gb=0.05, max_running=8, cost_profile=profile, page_size=16,
                  enable_prefix_cache=cache_on)
        outs[cache_on] = [o.token_ids for o in llm.generate(burst, GREEDY)]
        stats[cache_on] = llm.engine.stats()
        llm.engine.scheduler.check_integrity()
    assert outs[True] == outs[False]
    assert stats[True]["shared_waits"] >= 3 and stats[False]["shared_waits"] == 0
    assert stats[True]["prefill_tokens"] == 170 + 3 * (170 - 128)
    assert stats[False]["prefill_tokens"] == 4 * 170


def test_bad_requests_are_refused_and_nothing_leaks(tiny_model, profile):
    """Empty prompts, out-of-vocabulary ids and over-long requests raise ValueError naming the
    problem; an aborted request frees everything it held."""
    ref, path = tiny_model
    eng = _engine(path, profile, max_model_len=256)
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 97\)"):
        eng.add_request([1, 97], GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        eng.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="no tokenizer"):
        eng.add_request("text", GREEDY)
    rid = eng.add_request(harness.prompt(97, 100, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.abort(rid) and not eng.abort(rid)
    assert eng.step() == [] and not eng.has_unfinished()
    eng.scheduler.check_integrity()
    eng.scheduler.flush_cache()
    assert eng.scheduler.cache.kv_pool.num_free == eng.plan.num_pages
    assert eng.scheduler.cache.state_pool.num_free_active == eng.plan.num_active


def test_a_profile_far_off_the_measured_rounds_is_warned_about_once(tmp_path, caplog):
    """An engine whose cost profile predicts rounds 100x too slow (a profile fitted before a
    kernel change, say) logs one warning naming the profile once 64 rounds are measured, and
    none again."""
    path = tmp_path / "stale.json"
    CostModel(c0=0.5, c_dec=0.5).to_json(path)
    eng = Engine(cost_profile=str(path), memory_gb=0.05)
    eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), rid="a")
    with caplog.at_level("WARNING", logger="hybridserve.engine"):
        while eng.has_unfinished():
            eng.step()
    warned = [r.getMessage() for r in caplog.records if "its predictions" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0] and "hybridserve calibrate" in warned[0]


def test_output_kinds_return_the_same_request_each_their_way(profile):
    """The same greedy request as "cumulative", "delta" and "final" outputs (the built-in model's
    byte tokenizer, so characters span tokens): one last output, the same in all three; a delta's
    earlier outputs carry only what their step added (no prompt, no ids or text so far), which
    adds up to it; "final" returns
    nothing before it. With a stop string taken from that text, every kind stops at it."""
    eng = Engine(model="builtin", dtype="float32", memory_gb=0.05, max_running=8, cost_profile=profile)
    prompt = "def f(x): # caf\u00e9 \u2603\n"

    def run(params):
        rids = {kind: eng.add_request(prompt, params, outputs=kind) for kind in ("cumulative", "delta", "final")}
        seen = {kind: [] for kind in rids}
        kind_of = {rid: kind for kind, rid in rids.items()}
        while eng.has_unfinished():
            for o in eng.step():
                seen[kind_of[o.rid]].append(o)
        return seen

    seen = run(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    last = seen["cumulative"][-1]
    assert last.finished and len(last.token_ids) == 40 and len(seen["cumulative"]) > 1
    for kind in ("delta", "final"):
        end = seen[kind][-1]
        assert (end.finished, end.token_ids, end.text, end.finish_reason) == (True, last.token_ids, last.text, "length")
    assert len(seen["final"]) == 1
    deltas = seen["delta"]
    assert all(o.token_ids == [] and o.text == "" and o.prompt_token_ids == [] for o in deltas[:-1])
    assert deltas[-1].prompt_token_ids == last.prompt_token_ids == ByteTokenizer().encode(prompt)
    assert [t for o in deltas for t in o.new_token_ids] == last.token_ids
    assert "".join(o.new_text for o in deltas) == last.text
    stop = last.text[len(last.text) // 2: len(last.text) // 2 + 2]
    want = last.text[: last.text.find(stop)]
    stopped = run(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))
    for kind, outs in stopped.items():
        assert (outs[-1].text, outs[-1].finish_reason) == (want, "stop"), kind
    with pytest.raises(ValueError, match="outputs: 'partial' is not one of cumulative, delta, final"):
        eng.add_request(prompt, GREEDY, outputs="partial")
    assert not eng.has_unfinished()
