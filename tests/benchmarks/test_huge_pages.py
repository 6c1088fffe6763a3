"""benchmarks/huge_pages.py times both decode kernels over a pool on each page size."""
import re

from benchmarks import huge_pages


def test_huge_pages_benchmark_times_both_kernels_on_both_copies(capsys):
    huge_pages.main(["--repeats", "2", "--threads", "1", "--pool-mb", "32"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (paged_decode|delta_step)\b.* \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", out, re.M)
    assert [r[0] for r in rows] == ["paged_decode", "delta_step"]
    assert all(float(v) > 0 for r in rows for v in r[1:])
    assert out.splitlines()[0].startswith("4 KB pages:") and out.splitlines()[1].startswith("2 MB pages:")
