"""Seeded generators of the synthetic traces (runs form, see benchmarks/traces/__init__.py).

    python -m benchmarks.traces.generate chat --seed 0 --out chat.jsonl

Every length is drawn from a log-normal with the stated mean (sigma 0.8 unless said), every
arrival process is Poisson; the figures and where they come from are in
benchmarks/traces/README.md. Streams: each generator gives every fresh piece of text a
stream id of its own, so tokens are shared exactly where the structure says they are.
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
from typing import Callable

from benchmarks.traces import write

Run = list[int]  # [stream, offset, length]


class _Gen:
    """Shared draws: fresh text streams, log-normal lengths, Poisson arrivals."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.streams = itertools.count(1)

    def text(self, length: int) -> Run:
        return [next(self.streams), 0, max(1, length)]

    def length(self, mean: float, sigma: float = 0.8, lo: int = 1, hi: int = 1 << 20) -> int:
        mu = math.log(mean) - sigma * sigma / 2  # so that E[length] = mean
        return min(hi, max(lo, round(self.rng.lognormvariate(mu, sigma))))

    def gaps(self, rate: float):
        """Arrival times (s) of a Poisson process with `rate` per second."""
        t = 0.0
        while True:
            t += self.rng.expovariate(rate)
            yield t


def _line(t: float, prompt: list[Run], output: Run) -> dict:
    return {"timestamp": round(t * 1000), "prompt": [list(r) for r in prompt], "output": list(output)}


def chat(seed: int = 0, conversations: int = 120, rate: float = 0.4) -> list[dict]:
    """Multi-turn chat: each turn's prompt is the whole conversation so far (every earlier
    prompt and answer) plus a new user message; turns 1 + geometric (mean 3.5), user messages
    mean 120 tokens, answers mean 300, 15 s mean think time between turns."""
    g, lines = _Gen(seed), []
    for start in itertools.islice(g.gaps(rate), conversations):
        turns = 1 + min(40, int(g.rng.expovariate(1 / 2.5)))
        history: list[Run] = [g.text(g.length(250, 0.5))]  # the conversation's system / context text
        t = start
        for _ in range(turns):
            history.append(g.text(g.length(120)))
            answer = g.text(g.length(300, hi=2048))
            lines.append(_line(t, history, answer))
            history = history + [answer]
            t += g.rng.expovariate(1 / 15.0) + answer[2] * 0.02  # reading + typing, after the answer
    return lines


def agent(seed: int = 0, trajectories: int = 16, rate: float = 0.05) -> list[dict]:
    """Agent loops (SWE-agent-like): a 2,500-token system prompt shared by every trajectory,
    a task of mean 1,500 tokens, then 20-60 steps, each appending the model's action (mean
    150 tokens) and the tool's output (mean 900, up to 8K); a step every 4 s on average."""
    g, lines = _Gen(seed), []
    system = g.text(2500)
    for start in itertools.islice(g.gaps(rate), trajectories):
        context: list[Run] = [system, g.text(g.length(1500, 0.6))]
        t = start
        for _ in range(g.rng.randint(20, 60)):
            action = g.text(g.length(150, hi=1024))
            lines.append(_line(t, context, action))
            context = context + [action, g.text(g.length(900, 1.0, hi=8192))]
            t += g.rng.expovariate(1 / 4.0)
    return lines


def system(seed: int = 0, requests: int = 400, rate: float = 2.0, prompts: int = 4) -> list[dict]:
    """Many single-turn requests over a few shared system prompts (mean 4,000 tokens each,
    chosen with Zipf weights 1, 1/2, 1/3, ...), user messages mean 200 tokens, answers mean 200."""
    g = _Gen(seed)
    heads = [g.text(g.length(4000, 0.5, lo=512)) for _ in range(prompts)]
    weights = [1 / (i + 1) for i in range(prompts)]
    return [_line(t, [g.rng.choices(heads, weights)[0], g.text(g.length(200))], g.text(g.length(200)))
            for t in itertools.islice(g.gaps(rate), requests)]


def resend(seed: int = 0, prompts: int = 150, rate: float = 0.5, share: float = 0.4) -> list[dict]:
    """Exact resends (retries, regenerate): distinct prompts of mean 3,000 tokens; 40% of the
    requests are an identical resend of an earlier prompt, 1-60 s after it."""
    g, lines = _Gen(seed), []
    for t in itertools.islice(g.gaps(rate), prompts):
        prompt = [g.text(g.length(3000, 0.7, lo=64))]
        lines.append(_line(t, prompt, g.text(g.length(250))))
        while g.rng.random() < share:  # geometric number of resends: 40% of requests overall
            t += g.rng.uniform(1, 60)
            lines.append(_line(t, prompt, g.text(g.length(250))))
    return lines


def short(seed: int = 0, conversations: int = 200, rate: float = 1.0) -> list[dict]:
    """Short prompts that stay under 528 tokens (the smallest block vLLM raises its grid to):
    a 256-token shared system prompt, a user message of mean 80 tokens (at most 200), an
    answer of mean 60 (at most 64), two turns."""
    g, lines = _Gen(seed), []
    head = g.text(256)
    for t in itertools.islice(g.gaps(rate), conversations):
        history = [head, g.text(g.length(80, hi=100))]
        answer = g.text(g.length(60, hi=64))
        lines.append(_line(t, history, answer))
        history = history + [answer, g.text(g.length(40, hi=40))]
        lines.append(_line(t + g.rng.expovariate(1 / 10.0), history, g.text(g.length(40, hi=64))))
    return lines


GENERATORS: dict[str, Callable[..., list[dict]]] = {
    "chat": chat, "agent": agent, "system": system, "resend": resend, "short": short,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(GENERATORS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSONL file to write")
    args = ap.parse_args(argv)
    write(args.out, GENERATORS[args.name](args.seed))


if __name__ == "__main__":
    main()
