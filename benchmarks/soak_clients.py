"""The soak's clients: what each request sends (`Plan`, drawn by `Workload`), how its client
behaves, and how its end is judged (`Outcome`).

    behaviour     client                                      a good end
    read          reads the whole response                    complete (stop/length) or an explicit error
    leave         stream: closes after `leave_after` events;  aborted (or complete, if it ended first)
                  non-stream: gives up after `leave_after` s
    never_read    stream: takes the headers, reads nothing    aborted
                  for `hold_s`, closes
An explicit error is a 4xx/5xx JSON body in the OpenAI shape, or a stream's error event
followed by [DONE]. Anything else a reading client sees (no data for `hang_s`, a cut stream,
[DONE] without a finish_reason, finish_reason "abort", a non-OpenAI error body) is lost.
"""
from __future__ import annotations

import asyncio
import json
import random
import string
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import httpx

VOCAB = 320  # the built-in model's byte tokenizer; one ASCII character is one token
TEXT = string.ascii_lowercase + "     \n.,"
# field -> values a hostile client sends (refused with a 400, or served)
HOSTILE = {
    "temperature": [1e-300, 1e-39, 5e-324, 1e-8, 100.0],
    "top_p": [1e-300, 1e-46, 1e-9],
    "top_k": [-1, VOCAB - 1, 10**6],
    "max_tokens": [10**9, 2**31, 2**63, 0],
    "stop": ["", "x" * 4096, [" ", "e", "a"], [""] * 3],
    "n": [2, 0],
    "presence_penalty": [0.5],
    "logprobs": [21],
    "seed": [2**64, -1],
}


@dataclass(frozen=True)
class Plan:
    """One request: its route and body, how its client behaves, and what was hostile in it."""

    i: int
    path: str  # /v1/completions | /v1/chat/completions
    body: dict
    behaviour: str = "read"  # read | leave | never_read
    leave_after: float = 0  # leave: events (stream) or seconds (non-stream)
    hold_s: float = 0  # never_read
    hostile: tuple[str, ...] = ()
    burst: int | None = None  # plans of one burst are sent at once
    whale: bool = False

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def brief(self, whole: bool = False) -> dict:
        """The plan for a report (long prompts and stop strings cut short unless `whole`)."""
        body = self.body if whole else _cut(self.body)
        return {"i": self.i, "path": self.path, "body": body, "behaviour": self.behaviour, "hostile": self.hostile}


def _cut(v, n: int = 48):
    if isinstance(v, dict):
        return {k: _cut(x, n) for k, x in v.items()}
    if isinstance(v, list):
        return [_cut(x, n) for x in v[:n]] + ([f"... {len(v)} in all"] if len(v) > n else [])
    return v[:n] + f"... {len(v)} chars" if isinstance(v, str) and len(v) > n else v


@dataclass
class Outcome:
    plan: Plan
    end: str  # complete | error | aborted | lost
    detail: str  # finish reason, error kind or why it is lost
    latency_s: float
    ttft_s: float | None = None
    usage: dict | None = field(default=None, repr=False)


class Workload:
    """Seeded request plans against a KV pool of `capacity` tokens: prompts on shared prefixes
    (the prefix cache hits), random sampling settings, a share of hostile values, of leaving
    and of never-reading clients; bursts of long prompts that exhaust KV pages and checkpoint
    slots; whales whose max_tokens fill the whole pool."""

    def __init__(self, seed: int, capacity: int, prefixes: int = 8):
        self.rng, self.capacity = random.Random(seed), capacity
        self.prefixes = [self.text(self.rng.choice([32, 64, 128, 192, 256, 384])) for _ in range(prefixes)]
        self.count = 0

    def text(self, n: int) -> str:
        return "".join(self.rng.choices(TEXT, k=n))

    def plans(self, n: int, burst_every: int, burst_size: int, whales: int) -> list[Plan]:
        """`n` requests, `whales` of them whales one after the other (the small requests behind
        them must still be served), and a burst of `burst_size` before every `burst_every`-th."""
        first = self.rng.randrange(max(1, n - whales))
        whale_at = set(range(first, min(n, first + whales)))
        out: list[Plan] = []
        for k in range(n):
            if burst_every and k and k % burst_every == 0:
                out += [self.burst_member(k // burst_every) for _ in range(burst_size)]
            out.append(self.whale() if k in whale_at else self.one())
        return out

    def _plan(self, path: str, body: dict, **kw) -> Plan:
        self.count += 1
        return Plan(self.count - 1, path, body, **kw)

    def one(self) -> Plan:
        """A request on a shared prefix with random settings, some hostile, and a client that
        reads, leaves or never reads."""
        rng = self.rng
        chat = rng.random() < 0.4
        body = self.prompt(chat)
        body.update(max_tokens=rng.choice([1, 2, 4, 8, 8, 16, 16, 32, 64]), stream=rng.random() < 0.5,
                    temperature=rng.choice([0, 0, 0.7, 1.0, 1.5]), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            body.update(top_p=rng.choice([0.5, 0.9, 1.0]), top_k=rng.choice([0, 1, 20]), seed=rng.randrange(10**6))
        if rng.random() < 0.15:
            body["stop"] = rng.choice(["\n", ["e", "zz"], "the"])
        if rng.random() < 0.1:
            body["stop_token_ids"] = [rng.randrange(VOCAB)]
        if rng.random() < 0.1:
            body.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": rng.randint(0, 5)})
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        hostile = self.hostile(body, chat) if rng.random() < 0.15 else ()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        roll, keep = rng.random(), "max_tokens" in hostile
        if roll < 0.15:  # leaves mid-request
            after = rng.randint(1, 8) if body["stream"] else rng.uniform(0.05, 1.0)
            body["max_tokens"] = body["max_tokens"] if keep else rng.randint(64, 256)
            return self._plan(path, body, behaviour="leave", leave_after=after, hostile=hostile)
        if roll < 0.20 and body["stream"]:  # never reads
            body["max_tokens"] = body["max_tokens"] if keep else rng.randint(64, 1024)
            return self._plan(path, body, behaviour="never_read", hold_s=rng.uniform(1, 8), hostile=hostile)
        return self._plan(path, body, hostile=hostile)

    def prompt(self, chat: bool) -> dict:
        """A shared prefix and a random suffix: messages (content a string or text parts) or a
        prompt (text or token ids)."""
        prefix, suffix = self.rng.choice(self.prefixes), self.text(self.rng.randint(1, 96))
        if chat:
            content = suffix if self.rng.random() < 0.7 else [{"type": "text", "text": suffix}]
            return {"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": content}]}
        if self.rng.random() < 0.8:
            return {"prompt": prefix + suffix}
        return {"prompt": [ord(c) for c in prefix] + self.ids(len(suffix))}

    def hostile(self, body: dict, chat: bool) -> tuple[str, ...]:
        """Set one or two fields of `body` to hostile values; their names."""
        names = tuple(self.rng.sample(sorted(HOSTILE), self.rng.randint(1, 2)))
        for name in names:
            body[name] = self.rng.choice(HOSTILE[name])
        if "logprobs" in names and chat:
            body.update(logprobs=True, top_logprobs=21)
        return names

    def burst_member(self, burst: int) -> Plan:
        """A long distinct prompt: a burst of them needs many times the pool's pages and slots."""
        n = self.rng.randint(self.capacity // 8, self.capacity // 4)
        body = {"prompt": self.ids(n), "max_tokens": self.rng.randint(16, 48), "ignore_eos": True,
                "temperature": 0, "stream": self.rng.random() < 0.5}
        return self._plan("/v1/completions", body, burst=burst)

    def whale(self) -> Plan:
        """A stream whose prompt + max_tokens is the whole pool (accepted, then holds all of it)."""
        prompt = self.text(self.rng.randint(8, 64))
        body = {"prompt": prompt, "max_tokens": self.capacity - len(prompt), "ignore_eos": True, "stream": True}
        return self._plan("/v1/completions", body, hostile=("max_tokens",), whale=True)

    def probe(self) -> Plan:
        """A prompt of the whole pool less one token: served only if every cached page can go."""
        body = {"prompt": self.ids(self.capacity - 1), "max_tokens": 1, "temperature": 0}
        return self._plan("/v1/completions", body)

    def in_flight(self, n: int, max_tokens: int) -> list[Plan]:
        """Long requests, half streams, still running when the server is told to stop."""
        return [self._plan("/v1/completions", {"prompt": self.text(32), "max_tokens": max_tokens,
                                               "ignore_eos": True, "stream": i % 2 == 0}) for i in range(n)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]


# -- one client -----------------------------------------------------------------------------


async def run_one(client: httpx.AsyncClient, plan: Plan, on_event: Callable[[Plan], None] | None = None
                  ) -> Outcome:
    """Send `plan`, behave as it says, judge the end. `on_event` is called on each stream event."""
    t0 = time.perf_counter()
    try:
        if plan.stream:
            return await _stream(client, plan, t0, on_event)
        if plan.behaviour == "leave":
            try:
                r = await asyncio.wait_for(client.post(plan.path, json=plan.body), plan.leave_after)
            except asyncio.TimeoutError:
                return Outcome(plan, "aborted", "left", time.perf_counter() - t0)
        else:
            r = await client.post(plan.path, json=plan.body)
        return judge(plan, r.status_code, r.content, t0)
    except httpx.TimeoutException as e:  # no data for the client's timeout (hang_s)
        return Outcome(plan, "lost", f"hung: {type(e).__name__}", time.perf_counter() - t0)
    except httpx.TransportError as e:
        return Outcome(plan, "lost", f"transport: {type(e).__name__}", time.perf_counter() - t0)


async def _stream(client: httpx.AsyncClient, plan: Plan, t0: float, on_event) -> Outcome:
    finish = error = ttft = usage = None
    events = 0
    async with client.stream("POST", plan.path, json=plan.body) as r:
        if r.status_code != 200:
            return judge(plan, r.status_code, await r.aread(), t0)
        if plan.behaviour == "never_read":
            await asyncio.sleep(plan.hold_s)
            return Outcome(plan, "aborted", "never read", time.perf_counter() - t0)
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                return Outcome(plan, "lost", "a stream line that is not `data: `", time.perf_counter() - t0)
            if line == "data: [DONE]":
                break
            try:
                ev = json.loads(line[6:])
            except ValueError:
                return Outcome(plan, "lost", "a stream event that is not JSON", time.perf_counter() - t0)
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            events += 1
            if on_event:
                on_event(plan)
            error = ev.get("error", error)
            usage = ev.get("usage") or usage
            finish = next((c["finish_reason"] for c in ev.get("choices", []) if c.get("finish_reason")), finish)
            if plan.behaviour == "leave" and events >= plan.leave_after and finish is None:
                return Outcome(plan, "aborted", "left", time.perf_counter() - t0)
        else:  # the server closed the stream before [DONE]
            why = "an error event, then the stream was cut before [DONE]" if error else "stream cut before [DONE]"
            return Outcome(plan, "lost", why, time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    if error is not None:
        kind = " ".join(str(x) for x in ("stream", error.get("type"), error.get("code")) if x is not None)
        return Outcome(plan, "error", kind, dt)
    if finish in ("stop", "length"):
        return Outcome(plan, "complete", finish, dt, ttft, usage)
    return Outcome(plan, "lost", f"[DONE] after finish_reason={finish}", dt)


def judge(plan: Plan, status: int, content: bytes, t0: float) -> Outcome:
    """A whole (non-stream) response: complete, an OpenAI-shaped error, or lost."""
    dt = time.perf_counter() - t0
    try:
        body = json.loads(content)
    except ValueError:
        return Outcome(plan, "lost", f"HTTP {status} whose body is not JSON", dt)
    if status == 200:
        try:
            finish = body["choices"][0]["finish_reason"]
        except (KeyError, IndexError, TypeError):
            return Outcome(plan, "lost", "HTTP 200 without choices[0].finish_reason", dt)
        if finish in ("stop", "length"):
            return Outcome(plan, "complete", finish, dt, usage=body.get("usage"))
        return Outcome(plan, "lost", f"HTTP 200 with finish_reason={finish}", dt)
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
        return Outcome(plan, "lost", f"HTTP {status} not in the OpenAI error shape", dt)
    kind = " ".join(str(x) for x in (status, err["type"], err["code"]) if x is not None)
    return Outcome(plan, "error", kind + (f" ({err['param']})" if err["param"] else ""), dt)


def anomalies(outcomes: Iterable[Outcome]) -> list[str]:
    """Usage that contradicts the request: cached or generated tokens over what was possible."""
    found = []
    for o in outcomes:
        u, limit = o.usage, o.plan.body.get("max_tokens")
        if not u:
            continue
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if cached > u["prompt_tokens"]:
            found.append(f"request {o.plan.i}: cached_tokens {cached} > prompt_tokens {u['prompt_tokens']}")
        if isinstance(limit, int) and u["completion_tokens"] > limit:
            found.append(f"request {o.plan.i}: completion_tokens {u['completion_tokens']} > max_tokens {limit}")
    return found
