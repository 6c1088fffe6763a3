"""The step-time model: predicted wall time of one forward, from what the batch holds.

    t = c0 + c_tok * tokens
           + c_attn * attn_layers * sum_prefill(extend * (prefix + extend / 2))
           + c_prefix * attn_layers * sum_prefill(prefix)
           + c_dec_attn * attn_layers * sum_decode(context)
           + c_serial * max_prefill(ceil(extend / chunk))
           + c_dec * decode_rows

Context parallelism (`cp` ranks, models/layers/context_parallel.py) splits a prefill segment
of E >= cp * chunk tokens into cp contiguous slices that run side by side; the round waits for
the busiest rank: E / cp tokens of GEMMs, the last slice's attention pairs
E / cp * (prefix + E - E / (2 cp)), and ceil(E / cp / chunk) serial steps times (1 +
`cp_overhead`), the widened state pass that carries each slice's transition. The exchanged
states and KV are not priced (under 1% of a 1M-token round at NVLink rates; docs/distributed.md).

`host_bytes_per_s` is the host link (device <-> host tier copies: PCIe or NVLink-C2C on a
GPU, a memory copy on CPU); 0: unknown, and nothing is loaded from a host tier.

`c_serial` is the serial weight: a chunkwise linear-attention kernel walks each segment in
`chunk`-token steps, one after the other, so a segment of E tokens costs ceil(E / chunk)
steps of wall time however few tokens each holds, and a batch costs its longest segment's
steps (segments run side by side). Decode attention reads the whole context once per row
(memory-bound), so it has its own coefficient rather than sharing the prefill one; a prefill
segment also reads its cached prefix once (`c_prefix`), which a short chunk at a long prefix
(the serial policies late in a long prompt) pays on top of its query-key pairs.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

PROFILES = Path(__file__).parent / "profiles"
COEFFS = ("c0", "c_tok", "c_attn", "c_prefix", "c_dec_attn", "c_serial", "c_dec")


class BatchShape(NamedTuple):
    """What the cost of a forward depends on: (prefix, extend) per prefill segment and the
    context length of every decode row."""

    prefill: Sequence[tuple[int, int]] = ()
    decode: Sequence[int] = ()

    @property
    def tokens(self) -> int:
        return sum(e for _, e in self.prefill) + len(self.decode)


@dataclass(frozen=True)
class CostModel:
    c0: float = 0.0
    c_tok: float = 0.0
    c_attn: float = 0.0
    c_prefix: float = 0.0
    c_dec_attn: float = 0.0
    c_serial: float = 0.0
    c_dec: float = 0.0
    chunk: int = 64
    attn_layers: int = 1
    host_bytes_per_s: float = 0.0
    cp: int = 1
    cp_overhead: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)  # provenance: model, hardware, sources

    def __post_init__(self):
        for name in COEFFS:
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if self.attn_layers < 0:
            raise ValueError(f"attn_layers must be >= 0, got {self.attn_layers}")
        if self.cp < 1:
            raise ValueError(f"cp must be >= 1, got {self.cp}")
        if not math.isfinite(self.cp_overhead) or self.cp_overhead < 0:
            raise ValueError(f"cp_overhead must be a finite number >= 0, got {self.cp_overhead}")
        if not math.isfinite(self.host_bytes_per_s) or self.host_bytes_per_s < 0:
            raise ValueError(f"host_bytes_per_s must be a finite number >= 0, got {self.host_bytes_per_s}")

    def copy_time(self, nbytes: int) -> float:
        """Seconds to move nbytes over the host link (inf when the link is unknown)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.host_bytes_per_s if self.host_bytes_per_s else math.inf

    def features(self, shape: BatchShape) -> list[float]:
        """The regressors of `step_time`, in COEFFS order (the busiest rank's under `cp`)."""
        split = [(p, e, self.ranks_for(e)) for p, e in shape.prefill]
        tokens = sum(e / n for _, e, n in split) + len(shape.decode)
        attn = sum(e / n * (p + e - e / (2 * n)) for p, e, n in split) * self.attn_layers
        prefix = sum(p for p, _ in shape.prefill) * self.attn_layers
        dec_attn = sum(shape.decode) * self.attn_layers
        serial = max((math.ceil(e / n / self.chunk) * (1 + self.cp_overhead if n > 1 else 1) for _, e, n in split),
                     default=0)
        return [1.0, tokens, attn, prefix, dec_attn, serial, len(shape.decode)]

    def ranks_for(self, extend: int) -> int:
        """Ranks a prefill segment of `extend` tokens is split across (1 below cp * chunk)."""
        return self.cp if extend >= self.cp * self.chunk else 1

    def context_parallel(self, n: int) -> "CostModel":
        """The model with prefill segments split across n ranks (see the module docstring)."""
        return replace(self, cp=n)

    def step_time(self, shape: BatchShape) -> float:
        """Predicted seconds for one forward of a batch of this shape (0 for an empty batch)."""
        if not shape.prefill and not shape.decode:
            return 0.0
        return sum(c * f for c, f in zip(self.coefficients, self.features(shape)))

    def prefill_work(self, start: int, end: int) -> float:
        """Seconds of a segment's own work on [start, end) done in one round: its tokens, its
        query-key pairs and its serial steps (no per-round latency, no prefix read)."""
        _, tokens, attn, _, _, serial, _ = self.features(BatchShape([(start, end - start)]))
        return self.c_tok * tokens + self.c_attn * attn + self.c_serial * serial

    def serial_steps(self, extend: int) -> int:
        return math.ceil(extend / self.chunk)

    def on_gpus(self, n: int) -> "CostModel":
        """The model spread over n devices: the token (GEMM) and prefill-attention terms split n
        ways, perfectly (no communication priced); the per-forward latency, the serial chain
        and the decode terms (latency- or bandwidth-bound, MLA's latent replicated) stay."""
        if n < 1:
            raise ValueError(f"gpus must be >= 1, got {n}")
        if n == 1:
            return self
        return replace(self, c_tok=self.c_tok / n, c_attn=self.c_attn / n,
                       meta={**self.meta, "scaled": f"on_gpus({n})"})

    @property
    def coefficients(self) -> list[float]:
        return [getattr(self, n) for n in COEFFS]

    @classmethod
    def fit(cls, samples: Iterable[tuple[BatchShape, float]], chunk: int = 64, attn_layers: int = 1,
            meta: dict | None = None) -> "CostModel":
        """Least-squares coefficients (non-negative) from timed forwards (shape, seconds).

        Solved on relative error (each row weighted by 1 / time) so short decode steps count as
        much as long prefills. Coefficients whose feature never varies are left at 0.
        """
        import numpy as np

        probe = cls(chunk=chunk, attn_layers=attn_layers)
        rows = [(probe.features(s), t) for s, t in samples]
        if len(rows) < 2:
            raise ValueError(f"samples: need at least 2 timed forwards, got {len(rows)}")
        x = np.array([f for f, _ in rows], dtype=float)
        y = np.array([t for _, t in rows], dtype=float)
        w = 1.0 / np.maximum(y, 1e-9)
        active = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
        coef = np.zeros(x.shape[1])
        while active:  # non-negative least squares by dropping negative terms
            sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [j for j, c in zip(active, sol) if c >= 0]
        fitted: dict[str, Any] = dict(zip(COEFFS, coef.tolist()))
        return cls(**fitted, chunk=chunk, attn_layers=attn_layers, meta=meta or {})

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, name_or_path: str | Path) -> "CostModel":
        """A shipped profile by name (see scheduler/profiles/) or a JSON file."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PROFILES / f"{name_or_path}.json"
            if not path.is_file():
                known = sorted(p.stem for p in PROFILES.glob("*.json"))
                raise ValueError(f"profile {name_or_path!r} not found; shipped: {known}")
        return cls.from_json(path)


class Drift:
    """Whether a cost profile still describes the rounds it plans: the median of measured over
    predicted seconds across the last `window` rounds predicted at `min_predicted` s or more
    (shorter ones are mostly fixed costs the profile's c0 averages)."""

    def __init__(self, window: int = 64, min_predicted: float = 2e-3):
        self.ratios: deque[float] = deque(maxlen=window)
        self.min_predicted = min_predicted

    def observe(self, predicted: float, elapsed: float) -> float | None:
        """Record one round; the median ratio once `window` rounds are recorded, else None."""
        if predicted >= self.min_predicted and elapsed > 0:
            self.ratios.append(elapsed / predicted)
        return statistics.median(self.ratios) if len(self.ratios) == self.ratios.maxlen else None
