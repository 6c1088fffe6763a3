"""benchmarks/gemm.py times each path on row counts that change call by call, the same bits."""
import math

import pytest

from benchmarks import gemm
from kernels import native


@pytest.mark.skipif(native._bf16_gemm() is None, reason="no bf16 micro-kernels on this CPU (AMX)")
def test_gemm_benchmark_times_every_path(capsys, monkeypatch):
    t = gemm.row(40, 72, 64, repeats=3)
    assert set(t) == {"ours", "torch-same", "torch-new", "torch-pad"} and all(0 < v < math.inf for v in t.values())
    monkeypatch.setattr(gemm, "SHAPES", [(8, 40, 64)])
    gemm.main(["--repeats", "2", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].split()[:5] == ["8", "x", "40", "x", "64"]
