"""hybridserve/host.py: the thread governor follows the cores other processes keep busy; a
frozen heap is out of the garbage collector's reach until it is unfrozen."""
from __future__ import annotations

import gc
import os
import weakref

from hybridserve import host
from hybridserve.host import ThreadGovernor

TICK = os.sysconf("SC_CLK_TCK")


class FakeHost:
    """A /proc/stat file, a clock and this process's CPU time, all advanced by hand."""

    def __init__(self, tmp_path):
        self.path = tmp_path / "stat"
        self.now, self.own = 100.0, 0.0
        self.busy: dict[str, float] = {}  # cpu name -> busy seconds so far
        self.calls: list[int] = []

    def governor(self, ceiling: int) -> ThreadGovernor:
        cpus = sorted(f"cpu{c}" for c in os.sched_getaffinity(0))
        self.busy = dict.fromkeys(cpus, 0.0)
        self.write()
        return ThreadGovernor(ceiling, self.calls.append, interval=0.2, clock=lambda: self.now,
                              stat_path=str(self.path), own_cpu=lambda: self.own)

    def write(self) -> None:
        total = sum(self.busy.values())
        lines = [f"cpu  {int(total * TICK)} 0 0 999999 0 0 0 0 0 0"]
        # busy as user ticks, the rest idle; the aggregate line must not be counted
        lines += [f"{c} {int(b * TICK)} 0 0 {int(1000 * TICK)} 0 0 0 0 0 0" for c, b in self.busy.items()]
        lines.append("intr 12345")
        self.path.write_text("\n".join(lines) + "\n")

    def advance(self, seconds: float, others_cores: float, own_cores: float = 0.0) -> None:
        """`seconds` pass with other processes busy on `others_cores` cores and this one on
        `own_cores` (spread over the CPUs, each at most 1)."""
        self.now += seconds
        self.own += own_cores * seconds
        load = others_cores + own_cores
        for c in self.busy:
            take = min(1.0, load)
            self.busy[c] += take * seconds
            load -= take
        self.write()


def test_threads_follow_the_cores_others_keep_busy(tmp_path):
    fake = FakeHost(tmp_path)
    n = len(os.sched_getaffinity(0))
    gov = fake.governor(ceiling=n)
    assert gov.update() == n  # no interval has passed: the ceiling
    fake.advance(0.5, others_cores=1.0, own_cores=n - 1.0)
    expected = max(1, n - 1)
    assert gov.update() == expected and abs(gov.others - 1.0) < 0.05
    fake.advance(0.5, others_cores=0.0, own_cores=float(n))
    assert gov.update() == n  # others left: back to the ceiling
    assert fake.calls == ([expected, n] if expected != n else [])  # set only on change


def test_own_cpu_time_is_not_counted_as_load(tmp_path):
    fake = FakeHost(tmp_path)
    n = len(os.sched_getaffinity(0))
    gov = fake.governor(ceiling=n)
    fake.advance(1.0, others_cores=0.0, own_cores=float(n))  # our threads (spinning or working) on every CPU
    assert gov.update() == n and gov.others < 0.05 and fake.calls == []


def test_never_below_one_thread_nor_above_the_ceiling(tmp_path):
    fake = FakeHost(tmp_path)
    n = len(os.sched_getaffinity(0))
    gov = fake.governor(ceiling=1)
    fake.advance(1.0, others_cores=float(n))  # every CPU taken by others
    assert gov.update() == 1
    fake.advance(1.0, others_cores=0.0)
    assert gov.update() == 1 and fake.calls == []  # an idle machine does not raise it past the ceiling


def test_reads_the_stat_file_at_most_once_an_interval(tmp_path):
    fake = FakeHost(tmp_path)
    n = len(os.sched_getaffinity(0))
    gov = fake.governor(ceiling=n)
    fake.advance(0.1, others_cores=float(n))  # within the interval: not looked at
    assert gov.update() == n and fake.calls == []
    fake.advance(0.2, others_cores=float(n))
    assert gov.update() == 1


def test_load_while_idle_does_not_set_the_next_rounds_threads(tmp_path):
    fake = FakeHost(tmp_path)
    n = len(os.sched_getaffinity(0))
    gov = fake.governor(ceiling=n)
    fake.advance(0.1, others_cores=0.0, own_cores=float(n))  # a round
    gov.round_ended()
    fake.advance(5.0, others_cores=float(n))  # idle: a client starts up on every CPU
    assert gov.update() == n and fake.calls == []  # that window is dropped, the count kept
    fake.advance(0.3, others_cores=0.0, own_cores=float(n))  # the burst's rounds, the client waiting
    gov.round_ended()
    assert gov.update() == n and fake.calls == [] and gov.others < 0.1  # (tick rounding)
    fake.advance(0.3, others_cores=1.0, own_cores=n - 1.0)  # load during the rounds still counts
    gov.round_ended()
    assert gov.update() == max(1, n - 1)


def test_unreadable_stat_keeps_the_ceiling(tmp_path):
    gov = ThreadGovernor(2, lambda t: (_ for _ in ()).throw(AssertionError("must not set threads")),
                         stat_path=str(tmp_path / "missing"))
    assert gov.update() == 2


def test_spin_policy_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    host.spin_policy()
    assert "GOMP_SPINCOUNT" not in os.environ  # a wait policy the user chose stands
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    host.spin_policy()
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    host.spin_policy()
    assert os.environ["GOMP_SPINCOUNT"] == str(host.SPIN_COUNT)


def test_engine_governs_its_threads_and_reports_them():
    import torch

    from hybridserve import LLM, SamplingParams
    from hybridserve.metrics import Metrics

    before = torch.get_num_threads()
    try:
        llm = LLM("builtin")
        llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=2))
        stats = llm.engine.stats()
        assert 1 <= stats["threads"]["threads"] <= before and stats["threads"]["others_busy"] >= 0
        text = Metrics(llm.engine.stats).render()[0].decode()
        assert "hybridserve_cpu_threads " in text and "hybridserve_cpu_others_busy_cores " in text
        off = LLM("builtin", adaptive_threads=False)
        off.generate("def f(x):", SamplingParams(temperature=0, max_tokens=2))
        assert "threads" not in off.engine.stats()
    finally:
        torch.set_num_threads(before)


class Node:
    pass


def test_frozen_heap_is_not_collected_until_unfrozen():
    loop = Node()
    loop.me = loop  # a reference cycle: only the collector frees it
    alive = weakref.ref(loop)
    garbage = Node()
    garbage.me = garbage
    gone = weakref.ref(garbage)
    del garbage
    try:
        assert host.freeze_heap() > 0 and gone() is None  # collected first, then frozen
        del loop
        gc.collect()
        assert alive() is not None  # unreachable, but frozen
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None
