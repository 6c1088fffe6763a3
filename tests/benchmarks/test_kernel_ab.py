"""benchmarks/kernel_ab.py compares two builds' kernels in one process: against itself the
outputs are the same bits, and a kernel the old module lacks is reported as skipped."""
import time
import types
from pathlib import Path

import pytest
import torch

from benchmarks import kernel_ab
from kernels import native

needs_kernel = pytest.mark.skipif(native.extension() is None, reason="CPU kernels not built")


@needs_kernel
def test_a_module_against_itself_gives_the_same_bits(capsys):
    rows = kernel_ab.main(["--old", str(Path(native.extension().__file__)), "--repeats", "2", "--threads", "1",
                           "--only", "conv_step bf16,delta_step gdn,add_rms_norm"])
    assert [r["case"] for r in rows] == ["conv_step bf16 768", "delta_step gdn", "add_rms_norm 64 x 256"]
    for r in rows:
        assert r["max_diff"] == 0 and r["old_us"] > 0 and r["new_us"] > 0
    out = capsys.readouterr().out
    assert "new/old" in out and "skipped" not in out


@needs_kernel
def test_a_kernel_the_old_module_lacks_is_skipped():
    r = kernel_ab.compare("conv", kernel_ab.CASES["conv_step bf16 768"], types.SimpleNamespace(), native.extension(),
                          repeats=1)
    assert r["case"] == "conv" and "conv_step" in r["skipped"]


@needs_kernel
def test_engine_mode_makes_each_call_on_both_modules(tmp_path):
    """--engine runs the workload through the engine with every call of the named kernels made on
    both modules: a module against itself, both sides are timed (from each kernel's second call on)
    and agree bit for bit."""
    module = str(Path(native.extension().__file__))
    rows = kernel_ab.main(["--old", module, "--engine", "builtin", "--cache", str(tmp_path), "--requests", "3",
                           "--prefix", "64", "--suffix", "16", "--new", "3", "--threads", "1"])
    assert [r["case"] for r in rows] == ["paged_prefill", "paged_decode"]
    for r in rows:
        assert r["calls"] > 0 and r["old_s"] > 0 and r["new_s"] > 0 and r["max_diff"] == 0
    assert native.extension() is not None and not isinstance(native.extension(), kernel_ab.Both)  # restored


@needs_kernel
@pytest.mark.parametrize("bad,message", [(["--engine", "llama"], "one of builtin"),
                                         (["--engine", "builtin", "--kernels", "paged_prefil"], "paged_prefil")])
def test_engine_mode_refuses_an_unknown_model_or_kernel(bad, message, capsys):
    """An --engine model without a peer row, or a --kernels name neither module has, is refused
    before anything runs, naming what was wrong; torch's thread count is left as it was (the
    default --threads 2 once stayed set, and a later bitwise test ran on two threads)."""
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit):
        kernel_ab.main(["--old", str(Path(native.extension().__file__)), "--threads", str(threads + 1), *bad])
    assert message in capsys.readouterr().err
    assert torch.get_num_threads() == threads


def test_engine_mode_gives_both_modules_the_same_states_and_keeps_the_new_ones():
    """A kernel that advances states in place (here delta_step's `state[slots]`) runs on both
    modules from the states the engine gave it, whichever goes first; the engine carries on with
    the new module's states, other slots untouched; a kernel that returns nothing is timed only."""
    def module(step: float):
        def delta_step(q, k, v, g, beta, state, slots, scale):
            state[slots] += step
            return state[slots].clone()
        return types.SimpleNamespace(delta_step=delta_step, heads_bf16=lambda *a: None)

    both = kernel_ab.Both(module(2.0), module(1.0), ["delta_step", "heads_bf16"])
    state, slots = torch.zeros(4, 3), torch.tensor([2, 0])
    for calls in (1, 2):  # the new module first, then the old one first
        out = both.delta_step(None, None, None, None, None, state, slots, 1.0)
        assert torch.equal(out, torch.full((2, 3), float(calls)))
        assert torch.equal(state[slots], torch.full((2, 3), float(calls))) and not state[[1, 3]].any()
        assert both.rows["delta_step"]["max_diff"] == 1.0 and both.rows["delta_step"]["calls"] == calls
    assert both.heads_bf16(None) is None and both.rows["heads_bf16"]["max_diff"] == 0


def test_engine_mode_gives_each_module_its_own_output_and_calls_an_old_one_without_out():
    """A kernel that writes into the round's output rows the engine gives (`out`) gets an empty one
    on each side instead, so each makes its own output and the two are compared, not one written
    over the other; a module built before the argument existed is called without it."""
    seen: dict[str, list] = {"old": [], "new": []}

    def conv(side: str, value: float, takes_out: bool):
        def causal_conv1d_slots(*args):
            if len(args) != 10 + takes_out:
                raise TypeError("incompatible function arguments")
            seen[side].append(args[10] if takes_out else None)
            return torch.full((2, 3), value)
        return types.SimpleNamespace(causal_conv1d_slots=causal_conv1d_slots)

    both = kernel_ab.Both(conv("old", 1.0, False), conv("new", 3.0, True), ["causal_conv1d_slots"])
    rows, args = torch.zeros(2, 3), [None] * 10
    args[3] = torch.zeros(4)  # the conv states (restored between the sides)
    for _ in range(2):
        y = both.causal_conv1d_slots(*args, rows)
        assert torch.equal(y, torch.full((2, 3), 3.0)) and not rows.any()
    assert seen["old"] == [None, None] and all(o.numel() == 0 for o in seen["new"]) and len(seen["new"]) == 2
    assert both.rows["causal_conv1d_slots"]["max_diff"] == 2.0


def test_engine_mode_keeps_the_arguments_after_out():
    """The arguments after `out` (chunk_ssd_slots' gated norm: z, weight, groups, eps) reach both
    modules as the engine gave them; only `out` is replaced by an empty tensor."""
    seen: dict[str, list] = {"old": [], "new": []}

    def ssd(side: str):
        def chunk_ssd_slots(*args):
            seen[side].append(args[13:])
            return torch.ones(2), torch.zeros(0)
        return types.SimpleNamespace(chunk_ssd_slots=chunk_ssd_slots)

    both = kernel_ab.Both(ssd("old"), ssd("new"), ["chunk_ssd_slots"])
    args, z = [None] * 13, torch.ones(4)
    args[6] = torch.zeros(3)  # the states
    both.chunk_ssd_slots(*args, torch.zeros(5), z, "w", 2, 1e-5)
    for side in ("old", "new"):
        (got,) = seen[side]
        assert got[0].numel() == 0 and got[1] is z and got[2:] == ("w", 2, 1e-5)


def test_engine_mode_alternates_which_module_goes_first_per_kernel():
    """Each kernel's calls alternate which module runs first (the second finds the inputs in cache),
    also where two kernels' calls interleave: with one flip shared by all kernels, a layer calling
    two of them would give each the same order every time."""
    order: list[str] = []

    def module(side: str):
        return types.SimpleNamespace(rms_norm=lambda: order.append(f"{side} norm"),
                                     causal_conv1d=lambda: order.append(f"{side} conv"))

    both = kernel_ab.Both(module("old"), module("new"), ["rms_norm", "causal_conv1d"])
    for _ in range(2):  # two layers, each a conv then a norm
        both.causal_conv1d()
        both.rms_norm()
    firsts = order[::2]
    assert firsts == ["new conv", "new norm", "old conv", "old norm"]


def test_engine_mode_does_not_time_a_kernels_first_call():
    """A kernel's first call is made on both modules and compared, but not timed (it pays the page
    faults of its first large output); the calls after it are."""
    def module():
        calls = []

        def rms_norm(x):
            calls.append(1)
            time.sleep(0.2 if len(calls) == 1 else 0.001)
            return x
        return types.SimpleNamespace(rms_norm=rms_norm)

    both = kernel_ab.Both(module(), module(), ["rms_norm"])
    for _ in range(3):
        both.rms_norm(torch.zeros(2))
    row = both.rows["rms_norm"]
    assert row["calls"] == 3 and 0.002 <= row["old_s"] < 0.1 and 0.002 <= row["new_s"] < 0.1


class _Recorder:
    """A module whose kernel calls go to `module`, each call's side appended to `log`."""

    def __init__(self, module, side: str, log: list):
        self.module, self.side, self.log = module, side, log

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            self.log.append(self.side)
            return fn(*args, **kwargs)
        return call


@needs_kernel
def test_engine_steps_prefill_on_the_new_module_then_alternate_by_step(tmp_path):
    """--steps: the prompts are prefilled on the new module only, then the timed decode steps run
    new, old, old, new, new, old: every kernel call of a step on that step's module."""
    log: list[str] = []
    new, old = _Recorder(native.extension(), "new", log), _Recorder(native.extension(), "old", log)
    res = kernel_ab.engine_steps("builtin", old, new, tmp_path, requests=3, prefix=64, suffix=16, steps=6)
    assert {side: len(t) for side, t in res["steps"].items()} == {"old": 3, "new": 3}
    assert all(t > 0 for ts in res["steps"].values() for t in ts)
    # each module's kernels timed on its own steps: the same kernels, each called on both
    assert set(res["kernels"]["old"]) == set(res["kernels"]["new"]) and res["kernels"]["new"]
    assert all(t > 0 for side in ("old", "new") for t in res["kernels"][side].values())
    runs = [side for i, side in enumerate(log) if i == 0 or log[i - 1] != side]
    assert runs == ["new", "old", "new", "old"]
    assert native.extension() is not None and not isinstance(native.extension(), _Recorder)  # restored


@needs_kernel
def test_engine_steps_mode_prints_both_modules_steps(tmp_path, capsys):
    module = str(Path(native.extension().__file__))
    rows = kernel_ab.main(["--old", module, "--engine", "builtin", "--cache", str(tmp_path), "--requests", "2",
                           "--prefix", "64", "--suffix", "16", "--steps", "4", "--threads", "1"])
    assert rows[0]["steps"] == {"old": 2, "new": 2} and rows[0]["ratio"] > 0
    assert rows[0]["kernels"] and all(k["old_s"] > 0 and k["new_s"] > 0 for k in rows[0]["kernels"].values())
    out = capsys.readouterr().out
    assert "decode step" in out and all(name in out for name in rows[0]["kernels"])


@pytest.mark.parametrize("bad", [["--steps", "4"], ["--engine", "builtin", "--steps", "1"]])
def test_steps_needs_the_engine_and_two_steps(bad, capsys):
    with pytest.raises(SystemExit):
        kernel_ab.main(["--old", "x.so", *bad])
    assert "--steps" in capsys.readouterr().err


@needs_kernel
def test_engine_steps_refuses_an_old_module_without_the_new_ones_kernels(tmp_path):
    """The engine calls whatever kernels the checkout's wrappers call: an old build lacking one is
    refused by name before anything runs, not failed on mid-step."""
    new = native.extension()

    class Older:
        def __getattr__(self, name):
            if name == "softmax_moe":
                raise AttributeError(name)
            return getattr(new, name)

    with pytest.raises(SystemExit, match="softmax_moe"):
        kernel_ab.engine_steps("builtin", Older(), new, tmp_path, requests=2, prefix=64, suffix=16, steps=2)
