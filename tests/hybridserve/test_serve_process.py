"""`hybridserve serve` as a real process: shutting down under load (the answers that the
requests in flight get, the exit status) and running out of file descriptors."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks.soak_server import free_port, wait_up

PROFILE = {"c0": 0.01, "c_tok": 1e-4, "c_serial": 1e-3, "c_dec": 1e-3}
LONG = {"prompt": "a long answer", "max_tokens": 20_000, "temperature": 0, "ignore_eos": True}
GRACE_S = 1


def start(tmp_path, *flags: str, nofile: int | None = None) -> tuple[subprocess.Popen, str, object]:
    """`python -m hybridserve serve` on a free port (optionally under `ulimit -n nofile`), up;
    the process, its URL and its log file."""
    profile = tmp_path / "cost.json"
    profile.write_text(json.dumps(PROFILE))
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    cmd = [sys.executable, "-m", "hybridserve", "serve", "--port", str(port), "--cost-profile", str(profile),
           "--memory-gb", "0.25", "--max-running", "4", "--log-level", "info", *flags]
    if nofile:
        cmd = ["bash", "-c", f'ulimit -n {nofile} && exec "$@"', "serve", *cmd]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_up(proc, url, 90, log.name)
    return proc, url, log


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig, flags", [(signal.SIGTERM, ()), (signal.SIGINT, ()),
                                        (signal.SIGTERM, ("--engine-process",))],
                         ids=["SIGTERM", "SIGINT", "SIGTERM-engine-process"])
def test_signal_under_load_answers_everyone_then_exits_with_its_status(tmp_path, sig, flags):
    """On SIGTERM / SIGINT with requests in flight (past the grace period): the non-stream one
    gets a 503 JSON error in the OpenAI shape (code shutting_down), the stream an error event
    then `data: [DONE]`; the process exits within the grace period plus a few seconds, with
    status 128 + the signal's number. The same with the engine in its own process (--engine-process),
    which the server stops itself."""
    proc, url, log = start(tmp_path, "--shutdown-grace-s", str(GRACE_S), *flags)
    try:
        def stream() -> list[str]:
            with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                return [x for x in r.iter_lines() if x]

        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(httpx.post, url + "/v1/completions", json=LONG, timeout=60)
            lines = pool.submit(stream)
            time.sleep(1.0)  # both are decoding
            assert proc.poll() is None
            proc.send_signal(sig)
            t0 = time.monotonic()
            r, lines_ = plain.result(), lines.result()
        status = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        stop(proc)
    log.seek(0)
    text = log.read()
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "server_error"
    assert lines_[-1] == "data: [DONE]" and json.loads(lines_[-2][6:])["error"]["code"] == "shutting_down"
    assert status == 128 + sig, text
    assert took < GRACE_S + 8 and "Traceback" not in text, text


def test_out_of_descriptors_is_one_line_and_recovers(tmp_path):
    """With the open-file limit below what clients open, the server logs the condition once
    (no tracebacks), closes the idle connections after --request-timeout-s and serves again."""
    proc, url, log = start(tmp_path, "--request-timeout-s", "2", nofile=160)
    try:
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(300)]  # past the limit
        time.sleep(4)  # accept() failed on every retry meanwhile; the accepted ones timed out
        for s in held:
            s.close()
        time.sleep(1)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        stop(proc)
    log.seek(0)
    text = log.read()
    assert text.count("Too many open files") == 1 and "Traceback" not in text, text
