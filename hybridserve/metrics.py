"""Prometheus metrics of one server: latencies measured per request in the server, engine
counters and pool usage read from the AsyncEngine's stats snapshot at scrape time.

Token hit rate, split: kv_hit_tokens_total / cache_lookup_tokens_total (prompt tokens whose
KV was cached) and state_hit_tokens_total / cache_lookup_tokens_total (tokens actually
skipped: a hybrid model resumes only from a recurrent-state checkpoint).
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hybridserve_"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 600)

# engine stats key (cache stats under "cache.") -> counter name, help
COUNTERS = {
    "prefill_tokens": ("prefill_tokens", "Prompt tokens computed by prefill forwards (cache hits excluded)."),
    "decode_tokens": ("decode_tokens", "Tokens computed by decode rows."),
    "retractions": ("retractions", "Running requests retracted to free KV pages."),
    "shared_waits": ("shared_prefix_waits", "Rounds a request waited for another computing the prefix they share "
                                            "(it then resumes from that one's checkpoint)."),
    "cache.lookup_tokens": ("cache_lookup_tokens", "Prompt tokens looked up in the prefix cache at admission."),
    "cache.kv_hit_tokens": ("kv_hit_tokens", "Looked-up tokens whose attention KV was cached."),
    "cache.state_hit_tokens": ("state_hit_tokens", "Looked-up tokens resumed from a recurrent-state checkpoint "
                                                   "(the tokens prefill skipped)."),
    "cache.flops_saved": ("flops_saved", "Prefill FLOPs saved by state hits."),
    "cache.evicted_pages": ("evicted_pages", "KV pages evicted from the prefix cache."),
    "cache.evicted_checkpoints": ("evicted_checkpoints", "Checkpoints evicted from the prefix cache (moved to the "
                                                         "host tier when there is one)."),
    "cache.host_hit_tokens": ("host_hit_tokens", "State-hit tokens brought back from the host tier (the rest of "
                                                 "state_hit_tokens hit on the device)."),
    "cache.host_loads": ("host_loads", "Prefixes loaded back from the host tier."),
    "cache.bytes_to_host": ("host_bytes_written", "Bytes of KV and checkpoints moved to the host tier."),
    "cache.bytes_from_host": ("host_bytes_read", "Bytes of KV and checkpoints loaded back from the host tier."),
    "host_recomputes": ("host_recomputes", "Host-tier hits recomputed instead, the copy being priced slower."),
    "split_rounds": ("context_parallel_rounds", "Rounds whose longest prefill ran split across the context-parallel "
                                                "ranks."),
}
# gauge prefix -> stats["cache"] keys (total, free, held by the prefix cache), what it counts
POOLS = {
    "kv_pages": ("pages_total", "pages_free", "pages_cached", "KV pages"),
    "checkpoint_slots": ("checkpoints_total", "checkpoints_free", "checkpoints_cached",
                         "recurrent-state checkpoint slots"),
    "active_slots": ("active_total", "active_free", None, "active recurrent-state slots (one per running request)"),
}

class Metrics:
    """The registry of one app. `stats()` returns the engine's latest `Engine.stats()`."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished requests by finish reason (stop, length, abort, "
                                "error, queue_timeout).", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        r.register(_EngineCollector(stats))

    def request(self) -> "RequestTimer":
        """Start timing one request (call at its arrival)."""
        return RequestTimer(self)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """TTFT, inter-token latency and end-to-end latency of one request."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.perf_counter):
        self.m, self.clock = metrics, clock
        self.start = self.last = clock()
        self.first = True

    def tokens(self, n: int) -> None:
        """n new tokens arrived now."""
        if n <= 0:
            return
        now = self.clock()
        gap = now - self.last
        if self.first:
            self.m.ttft.observe(now - self.start)
            self.first, gap, n = False, 0.0, n - 1  # the rest of a first burst came with it
        for _ in range(n):
            self.m.itl.observe(gap / n)
        self.last = now

    def finish(self, reason: str, usage: dict | None = None) -> None:
        self.m.e2e.observe(self.clock() - self.start)
        self.m.requests.labels(reason).inc()
        if usage:
            self.m.prompt_tokens.inc(usage["prompt_tokens"])
            self.m.generation_tokens.inc(usage["completion_tokens"])


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily(PREFIX + "requests_waiting", "Requests queued, not yet admitted.", s["waiting"])
        yield GaugeMetricFamily(PREFIX + "requests_running", "Requests admitted (prefill or decode).", s["running"])
        if "threads" in s:  # CPU, adaptive threads (hybridserve/host.py ThreadGovernor)
            yield GaugeMetricFamily(PREFIX + "cpu_threads", "Intra-op threads of the last round.",
                                    s["threads"]["threads"])
            yield GaugeMetricFamily(PREFIX + "cpu_others_busy_cores", "Cores other processes kept busy (last "
                                    "sample).", s["threads"]["others_busy"])
        for key, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, _value(s, key))
        lookups = s["cache"]["lookup_tokens"]
        for kind in ("kv", "state"):
            rate = s["cache"][f"{kind}_hit_tokens"] / lookups if lookups else 0.0
            yield GaugeMetricFamily(PREFIX + f"{kind}_hit_rate", f"{kind}_hit_tokens / cache_lookup_tokens "
                                    "since start.", rate)
        yield _memory_bytes(s["cache"])
        rates = GaugeMetricFamily(PREFIX + "checkpoint_resume_rate", "Resumes per checkpoint written (smoothed), by "
                                  "the admission rule that wrote it; eviction weighs a checkpoint's FLOPs by it.",
                                  labels=["kind"])
        for kind, rate in s.get("resume_rates", {}).items():
            rates.add_metric([kind], rate)
        yield rates
        for name, (total, free, cached, what) in POOLS.items():
            c = s["cache"]
            yield GaugeMetricFamily(PREFIX + name + "_total", f"All {what}.", c[total])
            yield GaugeMetricFamily(PREFIX + name + "_used", f"{what.capitalize()} not free.", c[total] - c[free])
            if cached:
                yield GaugeMetricFamily(PREFIX + name + "_cached", f"{what.capitalize()} held by the prefix cache.",
                                        c[cached])


def _memory_bytes(c: dict) -> GaugeMetricFamily:
    """Bytes held now, by tier (device, host) and kind (kv, checkpoint)."""
    g = GaugeMetricFamily(PREFIX + "memory_bytes", "Bytes held by tier (device, host) and kind (kv: attention KV "
                          "pages of running requests and the prefix cache; checkpoint: recurrent-state checkpoints).",
                          labels=["tier", "kind"])
    pb, cb = c["page_bytes"], c["checkpoint_bytes"]
    ckpt = c["checkpoints_used"] * cb
    in_pages = ckpt if c["unified"] else 0  # under one budget checkpoints are pages of the KV pool
    g.add_metric(["device", "kv"], (c["pages_total"] - c["pages_free"]) * pb - in_pages)
    g.add_metric(["device", "checkpoint"], ckpt)
    g.add_metric(["host", "kv"], c["host_pages_cached"] * pb)
    g.add_metric(["host", "checkpoint"], c["host_checkpoints_cached"] * cb)
    return g


def _value(stats: dict, key: str) -> float:
    """stats["a"]["b"] for key "a.b"."""
    *parents, name = key.split(".")
    for part in parents:
        stats = stats[part]
    return stats[name]
