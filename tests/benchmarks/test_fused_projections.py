"""benchmarks/fused_projections.py runs both ways on the built-in model and leaves fusion on."""
import models.batch
from benchmarks import fused_projections
from models.layers import linear, mlp


def test_fused_projections_benchmark_runs_and_restores_the_settings(capsys):
    pad = mlp.PAD_FREE_ROWS
    fused_projections.main(["--models", "builtin", "--sequences", "4", "--prompt", "16", "--steps", "6",
                            "--threads", "1"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| builtin |")]
    assert len(row) == 1 and row[0].endswith("x |")
    assert linear.ENABLED and mlp.PAD_FREE_ROWS == pad


def test_fused_decode_bodies_benchmark_runs_and_leaves_them_on(capsys):
    fused_projections.main(["--models", "builtin", "--sequences", "4", "--prompt", "16", "--steps", "6",
                            "--threads", "1", "--compare", "bodies", "--dtype", "bfloat16"])
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| builtin |")]
    assert len(row) == 1 and row[0].endswith("x |")
    assert models.batch.FUSED_DECODE
