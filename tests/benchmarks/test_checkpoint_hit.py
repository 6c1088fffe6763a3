"""The checkpoint-hit benchmark's pieces: traces, the replayed policies' admission rules (each
reproducing the user report it models), the bounds, and the replay against the engine."""
from __future__ import annotations

import json

import pytest

from benchmarks.replay import GB, POLICIES, replay, vllm_block
from benchmarks.traces import BLOCK, Tokens, TraceRequest, load, parse, write
from benchmarks.traces.generate import GENERATORS

TOKENS = Tokens(vocab=256)


def run_of(stream: int, n: int, offset: int = 0) -> tuple[int, ...]:
    return TOKENS.run(stream, offset, n)


def reqs_of(*prompts, gap: float = 30.0, out: int = 4) -> list[TraceRequest]:
    """Requests spaced `gap` seconds apart (each finishes before the next arrives)."""
    return [TraceRequest(i * gap, tuple(p), run_of(10_000 + i, out)) for i, p in enumerate(prompts)]


def hits(policy: str, reqs, capacity: float = 40 * GB) -> dict:
    return replay(reqs, POLICIES[policy], capacity)


def test_mooncake_lines_synthesise_equal_tokens_for_equal_ids(tmp_path):
    """Equal hash ids give equal 512-token blocks, the prompt is cut to input_length, and the
    output has output_length tokens of its own; the runs form concatenates token runs."""
    path = tmp_path / "t.jsonl"
    write(path, [{"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
                 {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 9]},
                 {"timestamp": 2000, "prompt": [[3, 0, 10], [7, 5, 20]], "output": [4, 0, 6]}])
    a, b, c = load(path)
    assert (a.arrival, b.arrival) == (0.0, 1.5) and (len(a.prompt), len(b.prompt)) == (600, 700)
    assert a.prompt[:BLOCK] == b.prompt[:BLOCK] and a.prompt[BLOCK:] != b.prompt[BLOCK:600]
    assert len(a.output) == 3 and a.output != b.output[:3]
    assert c.prompt == TOKENS.run(3, 0, 10) + TOKENS.run(7, 5, 20) and len(c.output) == 6
    assert TOKENS.run(7, 500, 30) == TOKENS.block(7, 0)[500:] + TOKENS.block(7, 1)[:18]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="line 0: input_length 2000 does not fit 1 blocks"):
        load(bad)
    with pytest.raises(ValueError, match="needs 'hash_ids'"):
        parse({"timestamp": 0}, TOKENS, 3)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_traces_are_seeded(name):
    """The same seed gives the same trace, another seed another one."""
    gen = GENERATORS[name]
    assert gen(seed=3) == gen(seed=3) and gen(seed=3) != gen(seed=4)


def test_short_trace_stays_under_528_tokens():
    """Every request of the short trace, prompt and answer, stays under vLLM's smallest raised block."""
    tokens = Tokens()
    reqs = [parse(d, tokens, i) for i, d in enumerate(GENERATORS["short"]())]
    assert max(len(r.prompt) + len(r.output) for r in reqs) < 528


def test_vllm_block_reproduces_the_reported_528():
    """vLLM's block formula gives 528 tokens for Qwen3.5-4B (an fp32 GDN state of 2,146,304 B
    per layer against 4,096 B of KV per token per layer, vllm#40696) and 1888 for this model."""
    assert vllm_block(per_layer_state=2_146_304, per_layer_kv=4096) == 528
    assert vllm_block() == 1888 and vllm_block(chunk=64) == 1920


def test_vllm_align_never_hits_prompts_under_its_block():
    """vllm-align caches nothing shorter than its raised block (vllm#40696: 0% under 528 tokens);
    ours hits the shared 256-token head of the same prompts."""
    head = run_of(1, 300)
    reqs = reqs_of(*[head + run_of(2 + i, 100) for i in range(4)])
    assert hits("vllm-align", reqs)["token_hit_rate"] == 0.0
    assert hits("ours-unified", reqs)["token_hit_rate"] > 0.3


def test_sglang_no_buffer_misses_an_identical_resend():
    """An identical resend gets 0 hits under sglang-no-buffer: its only states sit at chunk ends
    and at prompt + output, beyond the lookup's len - 1 (sglang#21158); ours resumes at the last
    grid point before the final token."""
    p = run_of(5, 1000)
    reqs = reqs_of(p, p)
    assert hits("sglang-no-buffer", reqs)["token_hit_rate"] == 0.0
    assert hits("ours-unified", reqs)["token_hit_rate"] == pytest.approx(960 / 2000)


def test_marconi_hits_at_a_branch_point_from_the_third_request():
    """Marconi keeps states only at branch points and the last decoded token: the second
    request that diverges from a cached path writes the branch state, the third one hits it."""
    shared = run_of(6, 640)
    reqs = reqs_of(*[shared + run_of(20 + i, 200) for i in range(3)])
    r = hits("marconi", reqs)
    assert r["token_hit_rate"] == pytest.approx(640 / sum(len(q.prompt) for q in reqs))


def test_unbounded_is_a_bound():
    """No policy hits more than the unbounded reference on a mixed trace."""
    tokens = Tokens()
    reqs = [parse(d, tokens, i) for i, d in enumerate(GENERATORS["chat"](conversations=12))]
    bound = hits("unbounded", reqs)["token_hit_rate"]
    for name in POLICIES:
        if name != "unbounded":
            assert hits(name, reqs, 2 * GB)["token_hit_rate"] <= bound + 1e-12, name


def test_replay_counters_equal_the_engines(monkeypatch):
    """The engine on the built-in model and the replay of the same trace, configuration and step
    schedule agree on every cache counter exactly."""
    from benchmarks import checkpoint_real

    reqs, arrive = checkpoint_real.small_trace(conversations=2)
    real, outs, eng = checkpoint_real.run_engine("ours-split", reqs, arrive)
    sim = checkpoint_real.run_replay(eng, reqs, arrive, outs)
    assert real["lookups"] == len(reqs) and real["state_hit_tokens"] > 0
    assert {k: real[k] for k in checkpoint_real.COUNTERS} == {k: sim[k] for k in checkpoint_real.COUNTERS}


def test_memory_table_marks_the_best_and_worst_split_and_the_previous_eviction():
    """The memory study's table: the one budget (and under the previous utility eviction) beside
    the best and worst static share, a share that refused requests named, not ranked."""
    from benchmarks.checkpoint_report import memory_table

    def row(policy, rate, capacity=2.5 * GB, rejected=0):
        return {"trace": "t", "policy": policy, "capacity_bytes": capacity, "token_hit_rate": rate,
                "rejected": rejected}

    rows = [row("ours-unified", 0.5), row("ours-unified-utility", 0.4), row("ours-split-30", 0.45),
            row("ours-split", 0.3), row("ours-split-90", 0.9, rejected=2), row("ours-unified+host1000", 0.7),
            row("unbounded", 0.8, capacity=0.0)]
    line = memory_table(rows).splitlines()[2]
    assert line.startswith("| t | 2.5 | 50.0% | 40.0% | 45.0% (0.3) | 30.0% (0.5) | - | 70.0% | 80.0% |")
    assert line.endswith("static split at 0.9 refuses requests longer than its KV pool")
