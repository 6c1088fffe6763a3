"""Request traces for the cache studies: one JSONL file a trace, tokens synthesised per block.

A line is one request, in either of two forms:

    Mooncake (FAST'25 release)  {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [h, ...]}
        one id per 512-token block of the prompt (the last block may be partial); an id is
        the same block wherever it appears.
    runs (the generated traces) {"timestamp": ms, "prompt": [[stream, offset, length], ...],
                                 "output": [stream, offset, length]}
        the prompt is the concatenation of token runs: tokens [offset, offset + length) of
        `stream`; "output" gives the tokens the request generates (a next turn whose prompt
        contains that run then matches it exactly).

Tokens are synthesised, never stored: block b of stream s (512 tokens) is drawn from a
generator seeded by (seed, s, b), so equal ids give equal tokens, in any process. A Mooncake
hash id h is block 0 of stream h (an id already stands for one block after one prefix); a
Mooncake request's output is `output_length` tokens of a stream of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

HERE = Path(__file__).parent
BLOCK = 512  # tokens per synthesised block (= the Mooncake hash-block size)
MOONCAKE = HERE / "mooncake_conversation.jsonl"
OUTPUT_STREAMS = 1 << 40  # scripted outputs of Mooncake requests use streams from here up


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival in seconds, the prompt, and the tokens it generates."""

    arrival: float
    prompt: tuple[int, ...]
    output: tuple[int, ...]


class Tokens:
    """Deterministic tokens per (stream, offset): 512-token blocks, cached as tuples."""

    def __init__(self, vocab: int = 256, seed: int = 0):
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        self.vocab, self.seed = vocab, seed
        self._blocks: dict[tuple[int, int], tuple[int, ...]] = {}

    def block(self, stream: int, index: int) -> tuple[int, ...]:
        key = (stream, index)
        if key not in self._blocks:
            rng = np.random.default_rng([self.seed, stream, index])
            self._blocks[key] = tuple(rng.integers(0, self.vocab, BLOCK).tolist())
        return self._blocks[key]

    def run(self, stream: int, offset: int, length: int) -> tuple[int, ...]:
        """Tokens [offset, offset + length) of a stream."""
        if offset < 0 or length < 0:
            raise ValueError(f"run: offset and length must be >= 0, got {offset}, {length}")
        out: list[int] = []
        first, last = offset // BLOCK, (offset + length - 1) // BLOCK
        for b in range(first, last + 1) if length else ():
            out.extend(self.block(stream, b))
        start = offset - first * BLOCK
        return tuple(out[start:start + length])


def parse(line: dict, tokens: Tokens, index: int) -> TraceRequest:
    """One trace line (either form) as a request; ValueError names what is wrong."""
    arrival = float(line["timestamp"]) / 1000.0
    if "hash_ids" in line:
        n, ids = int(line["input_length"]), line["hash_ids"]
        if not 0 < n <= BLOCK * len(ids):
            raise ValueError(f"line {index}: input_length {n} does not fit {len(ids)} blocks of {BLOCK}")
        prompt = tuple(t for h in ids for t in tokens.block(int(h), 0))[:n]
        output = tokens.run(OUTPUT_STREAMS + index, 0, int(line["output_length"]))
    elif "prompt" in line:
        prompt = tuple(t for s, o, n in line["prompt"] for t in tokens.run(s, o, n))
        s, o, n = line["output"]
        output = tokens.run(s, o, n)
    else:
        raise ValueError(f"line {index}: needs 'hash_ids' (Mooncake) or 'prompt' (runs)")
    if not prompt or not output:
        raise ValueError(f"line {index}: empty prompt or output")
    return TraceRequest(arrival, prompt, output)


def load(path: str | Path, vocab: int = 256, seed: int = 0, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests of a JSONL trace (all when None), in file order."""
    tokens, out = Tokens(vocab, seed), []
    with open(path) as f:
        for i, text in enumerate(f):
            if limit is not None and i >= limit:
                break
            if text.strip():
                out.append(parse(json.loads(text), tokens, i))
    return out


def write(path: str | Path, lines: Iterable[dict]) -> None:
    """Write trace lines (dicts in either form), sorted by timestamp."""
    rows = sorted(lines, key=lambda d: d["timestamp"])
    Path(path).write_text("".join(json.dumps(d, separators=(",", ":")) + "\n" for d in rows))


def prompt_tokens(reqs: Sequence[TraceRequest]) -> int:
    return sum(len(r.prompt) for r in reqs)


def mooncake_reuse(path: str | Path = MOONCAKE) -> float:
    """Share of prompt tokens an unbounded cache reusing 512-token blocks could skip, in
    arrival order: the leading blocks of each prompt that an earlier prompt already had."""
    seen: set[int] = set()
    reused = total = 0
    with open(path) as f:
        for text in f:
            line = json.loads(text)
            ids, n = line["hash_ids"], int(line["input_length"])
            lead = next((i for i, h in enumerate(ids) if h not in seen), len(ids))
            reused, total = reused + min(lead * BLOCK, n), total + n
            seen.update(ids)
    return reused / total
