import ast
import json
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import peers
from benchmarks.peer_models import MODELS, SPECIAL, VOCAB, build

VLLM_PYTHON = os.environ.get(peers.VLLM_ENV)
SMALL = ["--requests", "4", "--prefix", "32", "--suffix", "16", "--new", "4", "--threads", "1", "--repeats", "1",
         "--quiet-wait", "0", "--cost-profile", "builtin_cpu"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("peers")
    for name in MODELS:
        build(name, path)
    return path


def test_checkpoints_load_in_hybridserve(cache):
    """Both peer checkpoints load with their layer layout, dtype and parameter count as built."""
    from hybridserve import LLM

    kinds = {"qwen3-next": ("gdn", "gdn", "gdn", "attn") * 2, "nemotron-h": tuple("mamba2 mlp mamba2 attn mamba2 mlp "
                                                                                  "mamba2 mlp".split())}
    for name, spec in MODELS.items():
        path, params = build(name, cache)
        assert json.loads((path / "config.json").read_text())["dtype"] == spec.dtype
        engine = LLM(str(path), dtype=spec.dtype, memory_gb=0.05, cost_profile="builtin_cpu").engine
        assert tuple(engine.model_config.layer_kinds) == kinds[name]
        assert params == sum(p.numel() for p in engine.model.parameters())


def test_tokenizer_round_trips(cache):
    """decode -> encode gives back every id, special ones included (vllm bench serve's random dataset)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cache / "qwen3-next")
    ids = list(range(VOCAB))
    assert tok.vocab_size == VOCAB and tok.eos_token_id == SPECIAL.index("</s>")
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.encode(tok.decode(ids[7::13][::-1])) == ids[7::13][::-1]


def test_worker_returns_every_token(cache, tmp_path, capsys):
    """Our worker on a shrunken workload: one JSON line, `new` tokens for each request."""
    args = peers.parse_args(SMALL)
    work = tmp_path / "workload.json"
    work.write_text(json.dumps(peers.workload(args)))
    for name, spec in MODELS.items():
        peers.main(["--worker", "--model", str(cache / name), "--dtype", spec.dtype, "--prefix-cache", "on",
                    "--workload", str(work), *SMALL])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["engine"] == "hybridserve" and out["wall_s"] > 0 and out["threads"] == 1
        assert [len(t) for t in out["token_ids"]] == [4] * 4


def test_workload_warmup_shares_no_prefix():
    """The warm-up prompt does not start like the measured ones (it must not fill their prefix cache)."""
    work = peers.workload(peers.parse_args(SMALL))
    assert len(work["prompts"]) == 4 and all(len(p) == 48 for p in work["prompts"])
    assert len({tuple(p[:32]) for p in work["prompts"]}) == 1
    assert work["warmup"][0] != work["prompts"][0][0]


def test_agreement_counts_up_to_the_first_divergence():
    """Identical requests are counted; a divergence at token 3 of 4 scores 0.75, at 0 scores 0."""
    assert peers.agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == peers.Agreement(1, 1, 1.0)
    assert peers.agreement([[1, 2, 3, 4]], [[1, 2, 3, 9]]) == peers.Agreement(0, 1, 0.75)
    mixed = peers.agreement([[1, 2, 3, 4], [5, 6, 7, 8], [1, 1]], [[1, 2, 3, 4], [0, 6, 7, 8], [1, 1, 1]])
    assert mixed.identical == 1 and mixed.total == 3
    assert mixed.prefix_share == pytest.approx((1 + 0 + 2 / 3) / 3)
    with pytest.raises(ValueError, match="ours"):
        peers.agreement([[1]], [])


def test_speed_is_vllm_time_over_ours():
    """Our speed over vLLM's: 3 s against vLLM's 1 s reads 0.33x, 1 s against 2 s reads 2x."""
    assert peers.speed(3.0, 1.0) == pytest.approx(1 / 3)
    assert peers.speed(1.0, 2.0) == 2.0


def test_table_without_vllm_marks_its_columns():
    """A hybridserve-only row shows '-' in vLLM's columns; a full row shows speed and agreement."""
    ours = {"row": "r", "hybridserve_s": 2.0, "hybridserve_tok_s": 128.0}
    both = ours | {"vllm_s": 1.0, "vllm_tok_s": 256.0, "speed": 0.5, "paired_speed": 0.6,
                   "agreement": peers.Agreement(3, 4, 0.9).__dict__}
    lines = peers.table([ours, both]).splitlines()
    assert lines[2] == "| r | 2.00 | - | 128 | - | - | - | - |"
    assert lines[3] == "| r | 2.00 | 1.00 | 128 | 256 | 0.50x | 0.60x | 3/4 identical, 0.90 to first divergence |"


def test_paired_speed_is_the_median_of_each_repeats_ratio():
    """Each repeat's ratio pairs the runs made side by side: a repeat during which the host ran
    slower moves both runs, not their ratio; minima taken from different repeats (3 / 1 = 3x) can
    give a ratio no repeat showed, the median of the paired ones (2x) cannot."""
    ours, vllm = [2.0, 4.0, 1.0], [4.0, 12.0, 2.0]
    assert peers.speed(min(ours), min(vllm)) == 2.0 and peers.paired_speed(ours, vllm) == 2.0
    ours, vllm = [2.0, 1.0, 3.0], [4.0, 3.0, 3.0]  # ratios 2, 3, 1
    assert peers.speed(min(ours), min(vllm)) == 3.0 and peers.paired_speed(ours, vllm) == 2.0


def test_served_workload_mirrors_the_offline_one():
    """vllm bench serve gets the shared prefix and own tokens as offline, no ready check (it would
    fill the prefix cache), and each repeat's seed."""
    args = peers.parse_args([*SMALL, "--vllm-python", "python"])
    cmd = peers.bench_command("http://127.0.0.1:1", Path("m"), args, 2, Path("out/r.json"))
    flags = dict(zip(cmd, cmd[1:]))
    lengths = [flags[f"--random-{k}-len"] for k in ("prefix", "input", "output")]
    assert lengths == ["32", "16", "4"]
    assert flags["--num-prompts"] == "4" and flags["--seed"] == "2" and flags["--ready-check-timeout-sec"] == "0"
    assert "e2el" in flags["--percentile-metrics"].split(",")  # the client reports mean_e2el_ms only when asked


def test_served_round_target_engine_process_and_state_dtype_reach_only_our_side():
    """--target-step, --engine-process and --state-dtype are passed to our server alone (the
    state dtype to our offline worker too); without them ours keeps its defaults."""
    args = peers.parse_args([*SMALL, "--vllm-python", "python", "--target-step", "0.5", "--engine-process",
                             "--state-dtype", "bfloat16"])
    row = peers.ROWS["qwen3-next-cache"]
    ours = peers.server_command("hybridserve", row, Path("m"), 1, args, "p.json")
    assert ours[ours.index("--target-step") + 1] == "0.5" and "--engine-process" in ours
    assert ours[ours.index("--state-dtype") + 1] == "bfloat16"
    theirs = peers.server_command("vllm", row, Path("m"), 1, args, "p.json")
    assert not {"--target-step", "--engine-process", "--state-dtype"} & set(theirs)
    worker = peers.worker_command("hybridserve", row, Path("m"), Path("w.json"), args, None)
    assert worker[worker.index("--state-dtype") + 1] == "bfloat16"
    assert "--state-dtype" not in peers.worker_command("vllm", row, Path("m"), Path("w.json"), args, None)
    default = peers.parse_args([*SMALL, "--vllm-python", "python"])
    plain = peers.server_command("hybridserve", row, Path("m"), 1, default, "p.json")
    assert "--target-step" not in plain and "--engine-process" not in plain
    assert plain[plain.index("--cost-profile") + 1] == "p.json"
    assert "--cost-profile" not in peers.server_command("hybridserve", row, Path("m"), 1, default, None)
    assert plain[plain.index("--state-dtype") + 1] == "auto"


def test_serve_table_ratios():
    """The served table's last line per row is our speed over vLLM's for every metric."""
    metrics = dict.fromkeys(peers.SERVE_METRICS, 2.0)
    row = {"row": "r", "hybridserve": metrics, "vllm": metrics, "speed": dict.fromkeys(peers.SERVE_METRICS, 0.5)}
    lines = peers.serve_table([row]).splitlines()
    assert len(lines) == 5 and lines[-1] == "| r | hybridserve speed / vLLM |" + " 0.50x |" * len(peers.SERVE_METRICS)
    assert lines[0].count("|") == lines[1].count("|") == lines[-1].count("|")  # a header cell per metric


def test_peer_vllm_imports_nothing_from_this_repository():
    """peer_vllm.py runs under vLLM's python, which does not have this repository's packages."""
    tree = ast.parse((Path(peers.HERE) / "peer_vllm.py").read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "argparse", "importlib", "json", "os", "sys", "time", "vllm"}


def test_parent_runs_hybridserve_only(cache, tmp_path, monkeypatch):
    """Without vLLM the parent runs our worker processes and writes a table and JSON without vLLM's numbers."""
    monkeypatch.delenv(peers.VLLM_ENV, raising=False)
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "nemotron-h-nocache", "--cache", str(cache), "--output", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["row"] == peers.ROWS["nemotron-h-nocache"].label and "vllm_s" not in row and row["hybridserve_s"] > 0


def test_builtin_kimi_row_runs_ours_only(tmp_path, monkeypatch):
    """The built-in Kimi row runs our engine alone even with vLLM configured (vLLM-CPU cannot
    load KDA; a vLLM run would fail on the missing python), on byte-token prompts, in bf16."""
    out, commands = tmp_path / "peers.json", []
    real_run = peers.run_worker

    def run(cmd, log):
        commands.append(cmd)
        return real_run(cmd, log)

    monkeypatch.setattr(peers, "run_worker", run)
    peers.main([*SMALL, "--rows", "kimi-builtin-cache", "--cache", str(tmp_path), "--output", str(out),
                "--vllm-python", str(tmp_path / "no-python"), "--retries", "0"])  # one run, however loaded the machine
    record = json.loads(out.read_text())
    row = record["rows"][0]
    assert row["row"] == peers.ROWS["kimi-builtin-cache"].label and "vllm_s" not in row and row["hybridserve_s"] > 0
    assert row["sources"] == [record["sources"]] and record["sources_changed"] == []  # the worker saw our sources
    assert len(commands) == 1 and dict(zip(commands[0], commands[0][1:]))["--dtype"] == "bfloat16"
    prompts = json.loads((tmp_path.glob("runs/*/workload-*.json").__next__()).read_text())["prompts"]
    assert max(max(p) for p in prompts) < 256
    with pytest.raises(SystemExit, match="built-in"):
        peers.main(["--serve", "--rows", "kimi-builtin-cache", "--vllm-python", "python"])


def test_our_profile_is_what_an_engine_start_takes(tmp_path, monkeypatch):
    """Without --cost-profile the built-in model's runs take the engine's own default (None: the
    shipped profile of its dtype) and nothing is calibrated for it; a peer checkpoint is
    calibrated once (as a start would fit one); --cost-profile names the one of every row."""
    fitted = []
    monkeypatch.setattr(peers, "calibrate", lambda path, dtype, args, out, log: fitted.append(path) or out)
    default = peers.parse_args(SMALL[:-2])
    assert peers.our_profile(peers.BUILTIN, peers.BUILTIN, "bfloat16", default, tmp_path) is None and not fitted
    path = tmp_path / "nemotron-h"
    assert peers.our_profile("nemotron-h", path, "float32", default, tmp_path) == tmp_path / "nemotron-h.cost.json"
    assert fitted == [path]
    named = peers.parse_args(SMALL)
    assert peers.our_profile(peers.BUILTIN, peers.BUILTIN, "bfloat16", named, tmp_path) == "builtin_cpu"
    assert peers.our_profile("nemotron-h", path, "float32", named, tmp_path) == "builtin_cpu" and fitted == [path]


def test_sources_changed_during_a_run_are_flagged(tmp_path, monkeypatch, capsys):
    """A worker that ran other sources than the parent started with (an edit during the run)
    is named in the table's warning and in the JSON."""
    fingerprints = iter([peers.source_fingerprint(), "0123456789ab"])  # the first run's, then an edited one's

    def run(cmd, log):
        return {"engine": "hybridserve", "wall_s": 1.0, "token_ids": [[1] * 4] * 4, "sources": next(fingerprints)}

    monkeypatch.setattr(peers, "run_worker", run)
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "kimi-builtin-cache", "--cache", str(tmp_path), "--output", str(out),
                "--repeats", "2", "--retries", "0"])  # one run each, however loaded the machine
    record = json.loads(out.read_text())
    assert record["sources_changed"] == ["0123456789ab"]
    assert sorted(record["rows"][0]["sources"]) == sorted([record["sources"], "0123456789ab"])
    assert "WARNING: our sources changed during this run" in capsys.readouterr().out


def test_rows_take_turns_each_repeat(cache, tmp_path, monkeypatch):
    """Each repeat runs every row once (engines alternating within it) before the next repeat
    starts, each row on its own model and prompts (byte ids for the built-in model), and each
    row's minimum is taken over its own runs."""
    order, times = [], iter([3.0, 1.0, 2.0, 4.0])

    def run(cmd, log):
        args = dict(zip(cmd, cmd[1:]))
        prompts = json.loads(Path(args["--workload"]).read_text())["prompts"]
        order.append((Path(args["--model"]).name, max(max(p) for p in prompts) < 256))
        return {"engine": "hybridserve", "wall_s": next(times), "token_ids": [[1] * 4] * 4}

    monkeypatch.delenv(peers.VLLM_ENV, raising=False)
    monkeypatch.setattr(peers, "run_worker", run)
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "kimi-builtin-cache", "nemotron-h-nocache", "--cache", str(cache),
                "--output", str(out), "--repeats", "2", "--retries", "0"])
    assert order == [("builtin", True), ("nemotron-h", False)] * 2
    kimi, nemotron = json.loads(out.read_text())["rows"]
    assert kimi["runs_s"]["hybridserve"] == [3.0, 2.0] and kimi["hybridserve_s"] == 2.0
    assert nemotron["runs_s"]["hybridserve"] == [1.0, 4.0] and nemotron["hybridserve_s"] == 1.0


def test_one_process_runs_every_row_in_one_worker_alternating(cache, tmp_path, monkeypatch, capsys):
    """--one-process loads every row's model in one worker and alternates the rows' runs in it, the
    order reversed every repeat; the table is measure()'s, each later row's per-repeat speed against
    the first is printed, and vLLM (configured or not) does not run."""
    commands = []
    real = peers.worker_lines

    def lines(cmd, log):
        commands.append(cmd)
        return real(cmd, log)

    monkeypatch.setattr(peers, "worker_lines", lines)
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "kimi-builtin-cache", "nemotron-h-nocache", "--cache", str(cache), "--output",
                str(out), "--repeats", "2", "--one-process", "--vllm-python", str(tmp_path / "no-python")])
    assert len(commands) == 1 and "--specs" in commands[0]
    printed = capsys.readouterr().out
    order = [ln.split(" | ")[0].strip() for ln in printed.splitlines() if "(one process)" in ln]
    kimi, nemotron = peers.ROWS["kimi-builtin-cache"].label, peers.ROWS["nemotron-h-nocache"].label
    assert order == [kimi, nemotron, nemotron, kimi]
    assert f"{nemotron} against {kimi}, per repeat:" in printed and "hybridserve only" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == [kimi, nemotron] and all("vllm_s" not in r for r in rows)
    for r in rows:
        assert len(r["runs_s"]["hybridserve"]) == 2 and r["hybridserve_s"] == min(r["runs_s"]["hybridserve"])
    with pytest.raises(SystemExit, match="one-process"):
        peers.main([*SMALL, "--one-process", "--under-load", "1"])


def one_process_rows(cache, tmp_path, *flags) -> tuple[list[dict], str]:
    """The NemotronH row run by --one-process with `flags`: the results' rows and the row's label."""
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "nemotron-h-nocache", "--cache", str(cache), "--output", str(out), "--repeats",
                "1", "--one-process", *flags])
    return json.loads(out.read_text())["rows"], peers.ROWS["nemotron-h-nocache"].label


def test_one_process_runs_each_row_once_per_max_step(cache, tmp_path, capsys):
    """--one-process --max-step A B runs every row once per value in the one worker, each engine
    built with its value (the worker reports it), labels naming it; several values are refused
    without --one-process, any with --serve."""
    rows, label = one_process_rows(cache, tmp_path, "--max-step", "0.25", "2")
    assert [r["row"] for r in rows] == [f"{label}, max_step 0.25 s", f"{label}, max_step 2 s"]
    assert [r["max_step"] for r in rows] == [0.25, 2.0]
    assert f"{label}, max_step 2 s against {label}, max_step 0.25 s, per repeat:" in capsys.readouterr().out
    for bad in (["--max-step", "0.5", "1"], ["--serve", "--max-step", "1", "--vllm-python", str(tmp_path)]):
        with pytest.raises(SystemExit, match="max-step"):
            peers.main([*SMALL, "--cache", str(cache), *bad])


def test_one_process_runs_each_row_once_per_fp32_path(cache, tmp_path):
    """--one-process --fp32-path ours torch runs every row once per path in the one worker: through
    torch the micro-kernel is off for the run (the worker's probe says so), through ours it is on
    where this CPU runs it; labels name the path. --fp32-path is refused without --one-process."""
    from kernels import native

    rows, label = one_process_rows(cache, tmp_path, "--fp32-path", "ours", "torch")
    assert [r["row"] for r in rows] == [f"{label}, fp32 through ours", f"{label}, fp32 through torch"]
    assert [r["fp32_micro_kernel"] for r in rows] == [native.fp32_micro_kernel(), False]
    with pytest.raises(SystemExit, match="fp32-path"):
        peers.main([*SMALL, "--cache", str(cache), "--fp32-path", "torch"])


def test_under_load_reruns_each_row_beside_busy_loops(cache, tmp_path, monkeypatch):
    """--under-load N reruns the row with N spinning processes alive during the runs (and gone
    after), and records each run and the slowest / fastest spread."""
    monkeypatch.delenv(peers.VLLM_ENV, raising=False)
    seen, spawned = [], []
    real_busy, real_run = peers.busy_loops, peers.run_worker

    def busy(n):
        spawned.extend(real_busy(n))
        return spawned

    def run(cmd, log):
        seen.append(sum(h.poll() is None for h in spawned))  # busy loops alive during this run
        return real_run(cmd, log)

    monkeypatch.setattr(peers, "busy_loops", busy)
    monkeypatch.setattr(peers, "run_worker", run)
    out = tmp_path / "peers.json"
    peers.main([*SMALL, "--rows", "nemotron-h-nocache", "--cache", str(cache), "--output", str(out),
                "--under-load", "1"])
    row = json.loads(out.read_text())["rows"][0]
    loaded = row["loaded_runs_s"]["hybridserve"]
    assert row["busy_loops"] == 1 and len(loaded) == len(row["runs_s"]["hybridserve"])
    assert row["spread"]["hybridserve"] == pytest.approx(max(loaded) / min(loaded))
    assert seen[-len(loaded):] == [1] * len(loaded) and seen[0] == 0  # quiet runs first, then loaded ones
    assert all(h.poll() is not None for h in spawned)  # killed afterwards
    assert "spread" in peers.loaded_table([row])


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason=f"no vLLM python (set ${peers.VLLM_ENV})")
def test_vllm_worker_matches_ours_in_fp32(cache, tmp_path):
    """vLLM's worker on the fp32 NemotronH: every request's tokens, and the same greedy tokens as ours."""
    args = peers.parse_args([*SMALL, "--vllm-python", VLLM_PYTHON])
    work = tmp_path / "workload.json"
    work.write_text(json.dumps(peers.workload(args)))
    row, path = peers.ROWS["nemotron-h-nocache"], cache / "nemotron-h"
    outs = {e: peers.run_worker(peers.worker_command(e, row, path, work, args, "builtin_cpu"), tmp_path / "log")
            for e in peers.ENGINES}
    assert [len(t) for t in outs["vllm"]["token_ids"]] == [4] * 4
    assert peers.agreement(outs["hybridserve"]["token_ids"], outs["vllm"]["token_ids"]).identical == 4


def test_serve_needs_vllm(monkeypatch):
    """--serve without a vLLM python stops with a message naming the setting."""
    monkeypatch.delenv(peers.VLLM_ENV, raising=False)
    with pytest.raises(SystemExit, match=peers.VLLM_ENV):
        peers.main(["--serve"])


def test_a_worker_leaves_no_process_behind(tmp_path):
    """A worker's children (vLLM's engine processes) die with it: the worker here starts a
    grandchild that would sleep for a minute, prints its pid and its JSON line, and exits."""
    code = ("import subprocess, sys, json; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(json.dumps({'engine': 'x', 'pid': p.pid}))")
    out = peers.run_worker([sys.executable, "-c", code], tmp_path / "log")
    deadline = time.time() + 10
    while time.time() < deadline and Path(f"/proc/{out['pid']}").exists() and not zombie(out["pid"]):
        time.sleep(0.05)
    assert not Path(f"/proc/{out['pid']}").exists() or zombie(out["pid"])


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
