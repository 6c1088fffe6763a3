"""FLA's Triton kernels, run on CPU by the Triton interpreter, called through kernels/*/fla.py.

Proves that fla.py passes FLA the right layout, gates, scale, GVA, varlen, initial state and
checkpoint rounds: outputs, final states and checkpoint states == our torch paths (fp32).
Each test runs tests/kernels/fla_interpret.py in a fresh process (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(*cases: str, timeout: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.fla_interpret", *cases], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_close(results: dict, cases: tuple[str, ...]) -> None:
    assert sorted(results) == sorted(cases)
    for case, errs in results.items():
        assert {"o", "final"} <= set(errs), case
        for name, err in errs.items():
            assert err < 1e-4, f"{case}: {name} rel err {err:.2e}"


def test_fla_prefill_and_decode_under_interpreter():
    """fla_chunk_* (varlen, GVA, initial state, checkpoints) and fla_recurrent_* == torch (rel < 1e-4)."""
    cases = ("kda_chunk", "kda_recurrent", "gdn_chunk", "gdn_recurrent")
    assert_close(run_interpreted(*cases, timeout=300), cases)


@pytest.mark.slow
def test_fla_longer_prefills_under_interpreter():
    """256-token single-sequence KDA / GDN prefills with two checkpoints == torch (rel < 1e-4)."""
    cases = ("kda_chunk_long", "gdn_chunk_long")
    assert_close(run_interpreted(*cases, timeout=1200), cases)
