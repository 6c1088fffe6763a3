"""The `hybridserve` command: help for every flag, flags -> EngineConfig, generate, calibrate,
and serve shutting down cleanly on SIGTERM."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from benchmarks.soak_server import free_port, wait_up
from hybridserve import LLM, SamplingParams
from hybridserve import calibrate as calibrate_module
from hybridserve.cli import build_parser, engine_config, main
from hybridserve.config import OFFLINE_ROUND_TOKENS, OFFLINE_STEP, EngineConfig
from hybridserve.logs import PACKAGES, setup_logging
from scheduler.config import SchedulerConfig
from scheduler.cost import COEFFS, CostModel

PROFILE = {"c0": 0.01, "c_tok": 1e-4, "c_serial": 1e-3, "c_dec": 1e-3}
SMALL = ["--memory-gb", "0.25", "--max-running", "4"]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def subcommands() -> dict:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def parse(*argv: str):
    """argv through the parser and main()'s model resolution, as engine settings."""
    args = build_parser().parse_args(list(argv))
    args.model = args.model_pos or args.model or EngineConfig.model
    return args


def test_help_explains_every_flag(capsys):
    """Each subcommand's --help lists every engine setting (EngineConfig and its sections) as a
    flag with the field's own help text, and no argument lacks a help text."""
    settings = EngineConfig.settings()
    assert {"policy", "target_step", "eviction", "checkpoint_interval", "memory_gb"} <= set(settings)
    for name, sub in subcommands().items():
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for setting, (_, f) in settings.items():
            assert "--" + setting.replace("_", "-") in text, (name, setting)
            assert " ".join(f.metadata["help"].split())[:40] in text, (name, setting)
        assert "MODEL" in text
        for action in sub._actions:
            assert action.help and action.help.strip(), (name, action.dest)


def test_console_script_and_module_run():
    """The installed `hybridserve` console script and `python -m hybridserve` both run; --help
    names the three subcommands and --version prints the package version."""
    from hybridserve import __version__

    exe = shutil.which("hybridserve") or os.path.join(os.path.dirname(sys.executable), "hybridserve")
    for cmd in ([exe], [sys.executable, "-m", "hybridserve"]):
        out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert all(word in out.stdout for word in ("serve", "generate", "calibrate"))
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and __version__ in out.stdout


def test_flags_map_onto_config():
    """Defaults equal EngineConfig's defaults; each flag sets the setting of the same name,
    whichever section (engine, scheduler, cache) holds it."""
    args = parse("serve")
    assert engine_config(args) == EngineConfig() and (args.host, args.port) == ("127.0.0.1", 8000)
    args = parse("serve", "--memory-gb", "0.5", "--no-enable-prefix-cache", "--max-model-len", "4096",
                 "--policy", "tokens", "--mixed-chunk", "--page-size", "32", "--checkpoint-interval", "256")
    want = EngineConfig.from_settings(memory_gb=0.5, enable_prefix_cache=False, max_model_len=4096,
                                      policy="tokens", mixed_chunk=True, page_size=32, checkpoint_interval=256)
    assert engine_config(args) == want
    assert want.scheduler.policy == "tokens" and want.cache.checkpoint_interval == 256 and want.page_size == 32


def test_model_is_positional_or_a_flag(tmp_path, capsys):
    """`serve MODEL` (as `vllm serve MODEL`) and `serve --model MODEL` say the same; two
    different models are an error; no model means the built-in one."""
    assert parse("serve", str(tmp_path)).model == str(tmp_path)
    assert parse("serve", "--model", str(tmp_path)).model == str(tmp_path)
    assert parse("generate", str(tmp_path), "--prompt", "x").model == str(tmp_path)
    assert parse("serve").model == "builtin"
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(tmp_path), "--model", "builtin"])
    assert exit_.value.code == 2 and "twice" in capsys.readouterr().err


def test_bad_values_exit_2(capsys):
    """An unknown choice is an argparse error; a value a config rejects exits 2 naming the field."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--policy", "fastest"])
    assert exit_.value.code == 2 and "--policy" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--page-size", "0"]) == 2
    assert "page_size" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--target-step", "2"]) == 2  # above max_step
    assert "target_step" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


@pytest.fixture
def restore_logging():
    import logging

    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in PACKAGES}
    yield
    for n, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate


def test_log_level_covers_every_package(capsys, profile, restore_logging):
    """--log-level sets every package logger: at info the engine logs its start-up plan (model
    layout, policy, memory plan) to stderr, at warning it does not."""
    import logging

    from hybridserve import Engine

    setup_logging("info")
    assert all(logging.getLogger(n).level == logging.INFO for n in PACKAGES)
    Engine(cost_profile=profile, memory_gb=0.25, max_running=4)
    err = capsys.readouterr().err
    assert "memory plan" in err and "policy serial+deadline" in err and "kda/kda/kda/attn" in err
    setup_logging("warning")
    assert all(logging.getLogger(n).level == logging.WARNING for n in PACKAGES)
    Engine(cost_profile=profile, memory_gb=0.25, max_running=4)
    assert "memory plan" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="level"):
        setup_logging("loud")


def test_generate_prints_the_completion(capsys, profile):
    """`generate` prints the same greedy text as LLM.generate with the same settings."""
    code = main(["generate", "--prompt", "Hello there", "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
                 "--cost-profile", profile, *SMALL])
    out = capsys.readouterr()
    assert code == 0 and "6 generated" in out.err
    llm = LLM(cost_profile=profile, memory_gb=0.25, max_running=4)
    (want,) = llm.generate("Hello there", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert out.out == want.text + "\n"


def test_generate_fills_rounds_up_to_max_step_as_llm_does(capsys, profile, monkeypatch):
    """`generate` is offline: its rounds fill up to max_step (whatever --max-step says, the
    offline OFFLINE_STEP unless given) unless --target-step is given, and hold at most
    OFFLINE_ROUND_TOKENS tokens unless --max-round-tokens is given (also when both step flags
    are); `serve` keeps the server's target_step and max_step, and no token cap."""
    import hybridserve.llm

    seen = []

    class Spy(hybridserve.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sched = self.engine.config.scheduler
            seen.append((sched.target_step, sched.max_step, sched.max_round_tokens))

    monkeypatch.setattr(hybridserve.llm, "LLM", Spy)
    cases = ([], ["--target-step", "0.2"], ["--max-step", "0.05"],  # a max below serve's default target too
             ["--target-step", "0.2", "--max-step", "0.3"], ["--max-round-tokens", "4096"])
    for extra in cases:
        assert main(["generate", "--prompt", "x", "--max-tokens", "1", "--cost-profile", profile, *SMALL, *extra]) == 0
    cap = OFFLINE_ROUND_TOKENS
    assert seen == [(OFFLINE_STEP, OFFLINE_STEP, cap), (0.2, OFFLINE_STEP, cap), (0.05, 0.05, cap), (0.2, 0.3, cap),
                    (OFFLINE_STEP, OFFLINE_STEP, 4096)]
    served = engine_config(parse("serve")).scheduler
    assert (served.target_step, served.max_step) == (SchedulerConfig.target_step, SchedulerConfig.max_step)
    assert served.max_round_tokens is None
    assert engine_config(parse("serve", "--max-round-tokens", "8192")).scheduler.max_round_tokens == 8192
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_ = " ".join(capsys.readouterr().out.split())
    assert "(default: max_step; offline, as LLM)" in help_ and f"(default: {OFFLINE_STEP}; offline, as LLM)" in help_
    assert f"(default: {OFFLINE_ROUND_TOKENS}; offline, as LLM)" in help_


def test_calibrate_writes_a_profile(capsys, tmp_path, monkeypatch):
    """`calibrate` times forwards, writes a profile that CostModel.load accepts and prints every coefficient."""
    monkeypatch.setattr(calibrate_module, "PREFILLS", [[(0, 64)], [(0, 128)], [(64, 64)]])
    monkeypatch.setattr(calibrate_module, "DECODES", [[64], [64] * 4])
    monkeypatch.setattr(calibrate_module, "long_context", lambda max_context: [])
    out_path = tmp_path / "fitted.json"
    assert main(["calibrate", "--output", str(out_path), *SMALL]) == 0
    printed = capsys.readouterr().out
    cost = CostModel.load(out_path)
    assert cost.meta["model"] == "kimi_linear" and cost.meta["fitted_on"] == "5 timed forwards"
    assert all(name in printed for name in COEFFS)
    assert cost.c0 + cost.c_tok + cost.c_serial + cost.c_dec > 0


def test_serve_answers_then_exits_on_sigterm(profile, tmp_path):
    """`hybridserve serve` answers HTTP on its port; on SIGTERM it runs the lifespan shutdown (the
    engine thread is stopped and joined) and exits with status 128 + SIGTERM."""
    port = free_port()
    exe = shutil.which("hybridserve") or os.path.join(os.path.dirname(sys.executable), "hybridserve")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([exe, "serve", "--port", str(port), "--cost-profile", profile, "--log-level", "info",
                             *SMALL], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(proc, url, 90, log.name)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    text = log.read()
    assert "Application shutdown complete" in text and "Traceback" not in text, text


def test_calibration_reaches_the_served_context():
    """Without `quick`, calibration times attention over prefixes up to max_context (the
    per-pair cost grows once the prefix outgrows the caches), and never beyond it."""
    shapes = calibrate_module.long_context(16384)
    assert ((15360, 1024),) in [tuple(s.prefill) for s in shapes]
    assert ((0, 16384),) in [tuple(s.prefill) for s in shapes]
    small = calibrate_module.long_context(4096)
    assert max(p + e for s in small for p, e in s.prefill) == 4096
    assert max(c for s in small for c in s.decode) == 4096
