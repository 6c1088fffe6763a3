"""The soak: thousands of requests against the real server, then a leak check, then SIGTERM
with requests in flight (`python -m benchmarks.soak [--requests N] [--duration S] [--seed S]`).

    start     `python -m hybridserve serve` on a free loopback port, a pool small enough that
              bursts exhaust KV pages and checkpoint slots, --debug-integrity
    load      the Workload's plans (soak_clients.py), `concurrency` at a time, bursts at once
    leaks     idle: every KV page and checkpoint slot not held by the prefix cache is free, no
              active slot is held; a prompt of the whole pool is served (so every cached page
              can be evicted); then POST /debug/audit (served with --debug-integrity) flushes
              the cache, runs every pool's check_integrity() and counts the pages and slots
              still held: all must be 0
    shutdown  long requests in flight, SIGTERM: each ends complete or with an explicit error,
              the server exits
Prints the figures, writes them as JSON (benchmarks/results/soak.json); exit status 1 if a
request was lost, something leaked or the server did not exit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.soak_clients import Outcome, Plan, Workload, anomalies, run_one
from benchmarks.soak_server import ServerProcess
from hybridserve.config import EngineConfig

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Soak:
    """What the soak sends (`requests` one by one, a burst of `burst_size` every `burst_every`
    of them, `in_flight` at SIGTERM) and how the server is set up."""

    requests: int = 2000
    duration_s: float | None = None  # stop sending new requests after this long
    seed: int = 0
    concurrency: int = 16
    burst_every: int = 250
    burst_size: int = 24
    whales: int = 2
    in_flight: int = 12  # requests running when SIGTERM comes
    in_flight_tokens: int = 1500
    hang_s: float = 120.0  # a reading client that gets no data this long has lost its request
    queue_timeout_s: float | None = 60.0  # the server's --queue-timeout (None: unset, a request waits until served)
    memory_gb: float = 0.02  # 48 KV pages of 64 tokens, 7 checkpoint slots for the built-in model
    page_size: int = EngineConfig.page_size
    decode_reserve: float = 0.5  # under 1: bursts make the scheduler retract (the riskiest path for leaks)
    server_args: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("requests", "concurrency", "hang_s", "memory_gb", "page_size", "decode_reserve"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("burst_every", "burst_size", "whales", "in_flight", "in_flight_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.queue_timeout_s is not None and not 0 < self.queue_timeout_s < self.hang_s:
            raise ValueError(f"queue_timeout_s must be in (0, hang_s={self.hang_s}) or None (a request may wait that "
                             f"long before its answer), got {self.queue_timeout_s}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0 or None, got {self.duration_s}")

    @property
    def serve_flags(self) -> list[str]:
        """The `hybridserve serve` flags (server_args last: they override the others)."""
        return ["--log-level", "warning", "--memory-gb", str(self.memory_gb), "--page-size", str(self.page_size),
                "--decode-reserve", str(self.decode_reserve), "--debug-integrity",
                *(["--queue-timeout", str(self.queue_timeout_s)] if self.queue_timeout_s else []), *self.server_args]


def client(url: str, hang_s: float) -> httpx.AsyncClient:
    """A connection per request (no keep-alive): each request is a client of its own, and none
    races the server closing an idle connection."""
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(hang_s, connect=10),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


async def drive(url: str, plans: list[Plan], soak: Soak) -> list[Outcome]:
    """Every plan, `concurrency` at a time (a burst all at once), until `duration_s`."""
    sem, tasks = asyncio.Semaphore(soak.concurrency), []
    deadline = time.monotonic() + (soak.duration_s or float("inf"))
    t0, shown = time.monotonic(), time.monotonic()
    async with client(url, soak.hang_s) as http:
        for plan in plans:
            if time.monotonic() > deadline:
                break
            if plan.burst is None:
                await sem.acquire()
            task = asyncio.create_task(run_one(http, plan))
            if plan.burst is None:
                task.add_done_callback(lambda _: sem.release())
            tasks.append(task)
            if time.monotonic() - shown > 30:
                shown, done = time.monotonic(), [t.result() for t in tasks if t.done()]
                lost = sum(o.end == "lost" for o in done)
                print(f"  {shown - t0:5.0f} s: {len(tasks)} sent, {len(done)} ended, {lost} lost", file=sys.stderr)
        return list(await asyncio.gather(*tasks))


async def one(url: str, plan: Plan, hang_s: float) -> Outcome:
    async with client(url, hang_s) as http:
        return await run_one(http, plan)


def held(m: dict[str, float]) -> dict[str, int]:
    """What an idle server holds outside its prefix cache (all 0 when nothing leaked)."""
    return {"kv_pages": int(m["kv_pages_used"] - m["kv_pages_cached"]),
            "checkpoint_slots": int(m["checkpoint_slots_used"] - m["checkpoint_slots_cached"]),
            "active_slots": int(m["active_slots_used"]),
            "requests": int(m["requests_running"] + m["requests_waiting"])}


def check_leaks(server: ServerProcess, probe: Plan, hang_s: float) -> dict:
    """Once idle: nothing held outside the prefix cache, the probe (the whole pool) served, no
    IntegrityError logged. `leaks` counts each page, slot or request held, a failed probe as one."""
    idle = server.wait_idle(hang_s)
    before = held(server.metrics())
    served = asyncio.run(one(server.url, probe, hang_s))
    server.wait_idle(hang_s)
    after = held(server.metrics())
    server.wait_idle(hang_s)
    audit = httpx.post(server.url + "/debug/audit", timeout=60)
    flushed = audit.json() if audit.status_code == 200 else {"audit_failed": 1, "status": audit.status_code}
    integrity = server.log_count("IntegrityError") + (audit.status_code == 500)
    total = sum(before.values()) + (served.end != "complete") + integrity + sum(
        v for k, v in flushed.items() if k != "status")
    return {"leaks": total, "idle": idle, "held_after_load": before, "held_after_probe": after,
            "probe": f"{served.end}: {served.detail}", "held_after_flush": flushed, "integrity_errors": integrity}


async def stop_under_load(server: ServerProcess, plans: list[Plan], soak: Soak, wait_s: float = 5
                          ) -> tuple[list[Outcome], dict]:
    """Send `plans`, SIGTERM once every stream has its first event (or after `wait_s`: the rest
    are queued), judge how each ends."""
    started: set[int] = set()
    async with client(server.url, soak.hang_s) as http:
        tasks = [asyncio.create_task(run_one(http, p, on_event=lambda p: started.add(p.i))) for p in plans]
        streams, deadline = {p.i for p in plans if p.stream}, time.monotonic() + wait_s
        while not streams <= started and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stopped = asyncio.create_task(asyncio.to_thread(server.terminate, 60))
        outcomes = list(await asyncio.gather(*tasks))
        status, seconds = await stopped
    return outcomes, {"exit_status": status, "exit_s": round(seconds, 2), "streams_started": len(started & streams)}


def run(soak: Soak, out: Path) -> dict:
    """The whole soak; returns the summary (also written to `out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(soak.serve_flags, out.with_name(out.stem + "_server.log"))
    t0 = time.monotonic()
    try:
        server.start()
        pages = server.metrics()["kv_pages_total"]
        work = Workload(soak.seed, int(pages) * soak.page_size)
        plans = work.plans(soak.requests, soak.burst_every, soak.burst_size, soak.whales)
        t_load = time.monotonic()
        outcomes = asyncio.run(drive(server.url, plans, soak))
        load_s = time.monotonic() - t_load
        leaks = check_leaks(server, work.probe(), soak.hang_s)
        m = server.metrics()
        server.sample_rss()
        last, shutdown = asyncio.run(stop_under_load(server, work.in_flight(soak.in_flight, soak.in_flight_tokens),
                                                     soak))
    except httpx.TransportError as e:
        raise RuntimeError(f"the server stopped answering ({type(e).__name__}: {e}); see {server.log}") from e
    finally:
        server.kill()
    summary = summarize(outcomes, last, m, leaks, shutdown, server)
    summary.update(load_s=round(load_s, 1), total_s=round(time.monotonic() - t0, 1),
                   settings={**asdict(soak), "server": server.cmd[1:]})
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summarize(outcomes: list[Outcome], last: list[Outcome], m: dict, leaks: dict, shutdown: dict,
              server: ServerProcess) -> dict:
    every = outcomes + last
    ends = Counter(o.end for o in every)
    errors = Counter(o.detail for o in every if o.end == "error")
    done = sorted(o.latency_s for o in every if o.end == "complete")
    ttft = sorted(o.ttft_s for o in every if o.ttft_s is not None)
    server_errors = [o for o in outcomes if o.end == "error" and "queue_timeout" not in o.detail
                     and (o.detail.startswith("5") or "server_error" in o.detail)]  # under load, not shed
    lost = [o for o in every if o.end == "lost"]
    ok = not lost and not leaks["leaks"] and shutdown["exit_status"] is not None
    return {
        "ok": ok, "requests": len(every), "completions": ends["complete"], "aborts": ends["aborted"],
        "server_aborts": int(m.get('requests_total{finish_reason="abort"}', 0)),
        "retractions": int(m["retractions_total"]), "errors": ends["error"],
        "errors_by_kind": dict(errors.most_common()),
        "server_errors": len(server_errors), "server_errors_on_benign": sum(not o.plan.hostile for o in server_errors),
        "latency_p50_s": pct(done, 0.5), "latency_p99_s": pct(done, 0.99),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "peak_rss_mib": round(server.peak_rss_mib, 1), "lost": len(lost),
        "lost_by_reason": dict(Counter(o.detail for o in lost).most_common()),
        "lost_at_shutdown": sum(o.end == "lost" for o in last), "leaks": leaks["leaks"], "leak_check": leaks,
        "shutdown": {**shutdown, "ends": dict(Counter(f"{o.end}: {o.detail}" for o in last))},
        "whales": [f"{o.end}: {o.detail} after {o.latency_s:.1f} s" for o in outcomes if o.plan.whale],
        "anomalies": anomalies(every)[:20], "tracebacks_in_log": server.log_count("Traceback"),
        "kv_hit_rate": round(m["kv_hit_rate"], 3), "state_hit_rate": round(m["state_hit_rate"], 3),
        "prefill_tokens": int(m["prefill_tokens_total"]), "decode_tokens": int(m["decode_tokens_total"]),
        "lost_examples": [{"why": o.detail, "after_s": round(o.latency_s, 1), **o.plan.brief(whole=True)}
                          for o in lost[:10]],
        "server_error_examples": [{"error": o.detail, **o.plan.brief(whole=True)} for o in server_errors[:10]],
        "error_examples": {kind: next(o.plan.brief() for o in every if o.detail == kind) for kind in errors},
        "log": str(server.log),
    }


def pct(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None


def report(s: dict) -> None:
    sd = s["shutdown"]
    print(f"requests: {s['requests']} ({s['load_s']} s of load, {s['total_s']} s in all)")
    print(f"completions: {s['completions']}")
    print(f"aborts: {s['aborts']} client disconnects ({s['server_aborts']} counted by the server)")
    print(f"retractions: {s['retractions']}")
    print(f"tokens: {s['prefill_tokens']} prefilled, {s['decode_tokens']} decoded; prefix cache hit rate: "
          f"kv {s['kv_hit_rate']}, state {s['state_hit_rate']}")
    print(f"errors: {s['errors']} ({s['server_errors']} server errors, {s['server_errors_on_benign']} of them on "
          "requests with nothing hostile)")
    for kind, n in s["errors_by_kind"].items():
        print(f"  {n:6d}  {kind}")
    print(f"latency: p50 {s['latency_p50_s']} s, p99 {s['latency_p99_s']} s (completed); "
          f"ttft p50 {s['ttft_p50_s']} s, p99 {s['ttft_p99_s']} s (streams)")
    print(f"peak RSS: {s['peak_rss_mib']} MiB (the server process, VmHWM)")
    print(f"whales: {s['whales']}")
    print(f"shutdown: exit status {sd['exit_status']} after {sd['exit_s']} s; in flight: {sd['ends']}")
    print(f"lost: {s['lost']} ({s['lost_at_shutdown']} at shutdown) {s['lost_by_reason'] or ''}")
    for a in s["anomalies"]:
        print(f"  anomaly: {a}")
    lc = s["leak_check"]
    print(f"leaks: {s['leaks']} (held after load {lc['held_after_load']}, probe {lc['probe']}, "
          f"after flush {lc['held_after_flush']}, integrity errors {lc['integrity_errors']}; "
          f"{s['tracebacks_in_log']} tracebacks in {s['log']})")


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", formatter_class=fmt,
                                description="Thousands of requests against the real server, a leak check, then SIGTERM "
                                            "with requests in flight.")
    d = Soak()
    p.add_argument("--requests", type=int, default=d.requests, help="requests of the load phase")
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the request plans")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="clients at once (bursts come on top)")
    p.add_argument("--memory-gb", type=float, default=d.memory_gb, help="the server's --memory-gb")
    p.add_argument("--hang-s", type=float, default=d.hang_s, help="no data this long: the request is lost")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s,
                   help="the server's --queue-timeout (0: leave it unset, requests wait until served)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra `serve` flag, e.g. --server-arg=--policy=tokens (repeat for more)")
    p.add_argument("--output", type=Path, default=RESULTS / "soak.json", help="the JSON summary (the server's log "
                   "goes beside it)")
    a = p.parse_args(argv)
    soak = Soak(requests=a.requests, duration_s=a.duration, seed=a.seed, concurrency=a.concurrency,
                memory_gb=a.memory_gb, hang_s=a.hang_s, queue_timeout_s=a.queue_timeout or None,
                server_args=tuple(a.server_arg))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # so the server is stopped too
    summary = run(soak, a.output)
    report(summary)
    print(f"wrote {a.output}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
