"""The server under soak: `python -m hybridserve serve` as a subprocess on a free loopback
port (its output in a log file), its /metrics, its peak RSS, SIGTERM."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, url: str, timeout: float, log: object = "its log") -> None:
    """Return once the server process answers GET /health with 200; RuntimeError if it exits
    or `timeout` seconds pass first (then it is killed, so no server outlives its caller)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the server did not come up; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


class ServerProcess:
    """`python -m hybridserve serve` on a free loopback port, its output in `log`."""

    def __init__(self, flags: list[str], log: Path):
        self.port = free_port()
        self.url, self.log = f"http://127.0.0.1:{self.port}", log
        self.cmd = [sys.executable, "-m", "hybridserve", "serve", "--port", str(self.port), *flags]
        self.proc: subprocess.Popen | None = None
        self.peak_rss_mib = 0.0

    def start(self, timeout: float = 120) -> None:
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        wait_up(self.proc, self.url, timeout, self.log)

    def metrics(self) -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
                out[s.name.removeprefix("hybridserve_") + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["requests_running"] == m["requests_waiting"] == 0:
                return True
            time.sleep(0.2)
        return False

    def sample_rss(self) -> None:
        """Keep the peak resident set (VmHWM) while the process lives."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                kb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
            self.peak_rss_mib = max(self.peak_rss_mib, kb / 1024)
        except (OSError, StopIteration):
            pass

    def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM; (exit status or None if it had to be killed, seconds to exit)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        while self.proc.poll() is None and time.monotonic() - t0 < timeout:
            self.sample_rss()
            time.sleep(0.1)
        if self.proc.poll() is None:
            self.kill()
            return None, time.monotonic() - t0
        return self.proc.returncode, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_count(self, word: str) -> int:
        return self.log.read_text(errors="replace").count(word)
