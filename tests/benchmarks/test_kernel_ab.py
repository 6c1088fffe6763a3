"""benchmarks/kernel_ab.py compares two builds' kernels in one process: against itself the
outputs are the same bits, and a kernel the old module lacks is reported as skipped."""
import types
from pathlib import Path

import pytest

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
