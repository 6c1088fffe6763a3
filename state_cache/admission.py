"""Where checkpoints may go (the G grid) and which positions get one.

A position p means "the state after tokens [0, p)". Checkpoints sit only on multiples of
G = max(kernel chunk, page_size), so a resumed chunkwise kernel starts on a chunk boundary
and a checkpoint always ends on a page boundary of the KV it belongs to.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from state_cache.config import CacheConfig


def granularity(page_size: int, kernel_chunks: Mapping[str, int], grid: int | None = None) -> int:
    """G = max(page_size, every kernel chunk), after checking max % min == 0 for each kind;
    `grid`, when given, replaces G by a coarser grid (it must be a multiple of G).

    kernel_chunks maps a linear-layer kind to its kernel chunk, e.g. {"kda": 64} or
    {"mamba2": 256}. ValueError names the offending field.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    for kind, chunk in kernel_chunks.items():
        if chunk < 1:
            raise ValueError(f"kernel_chunks[{kind!r}] must be >= 1, got {chunk}")
        if max(chunk, page_size) % min(chunk, page_size):
            raise ValueError(
                f"kernel_chunks[{kind!r}]={chunk} and page_size={page_size}: "
                "the larger must be a multiple of the smaller"
            )
    g = max([page_size, *kernel_chunks.values()])
    for kind, chunk in kernel_chunks.items():
        if g % chunk:
            raise ValueError(f"kernel_chunks[{kind!r}]={chunk} does not divide G={g}")
    if grid is not None and (grid < 1 or grid % g):
        raise ValueError(f"checkpoint_grid={grid} must be a positive multiple of G={g} (max of page size and "
                         "kernel chunks)")
    return g if grid is None else grid


HOST_INTERVAL = 2048  # checkpoint_interval when it is unset and a host tier holds what the device evicts
CHUNK_ENDS = ("transient", "keep", "none")
LAST_PROMPT = ("before-final", "floor", "none")
DECODE = ("rolling", "every", "none")


class DecodeCheckpoint(enum.Enum):
    """What to do with the state a decode step just produced."""

    NONE = "none"
    ROLLING = "rolling"  # overwrite the request's one pending slot: the latest G-position wins
    KEEP = "keep"  # a checkpoint_interval position: keep it in its own slot


@dataclass(frozen=True)
class CheckpointAdmission:
    """Which positions get a checkpoint; each rule can be switched off (CacheConfig).

    Prefill admits: the end of a chunk that ends on the grid (every stashed middle chunk
    under G-aligned cuts, and a G-aligned prompt end) [chunk_ends: "keep"; "transient": the
    deepest one of a running request only, for concurrent requests with the same prefix and
    for the request itself after a retraction, dropped when a deeper one is stashed and when
    the request finishes (see `transient`); "none"]; near the prompt's end
    [last_prompt]: "before-final", the last G-position before its last token (an identical
    resend resumes there), or "floor", the last G-position of the prompt (a prompt of k * G
    tokens then keeps a state no lookup can use, which is the behaviour of engines that
    checkpoint the last full block); the branch point found by match_prefix (future requests
    diverge there again) [branch_points]; the last multiple of `hedge` in the prompt (a next
    turn that does not repeat the prompt's tail exactly still resumes there); every
    `interval` tokens.
    Decode [decode_mode]: "rolling" keeps the latest multiple of decode_grid (default G), so a
    finished request leaves the last one of prompt + output (the next turn of a
    conversation starts there); "every" keeps each; plus every `interval` tokens.
    """

    granularity: int
    interval: int | None = None
    chunk_ends: str = "transient"
    last_prompt: str = "before-final"
    branch_points: bool = True
    decode_mode: str = "rolling"
    decode_grid: int | None = None
    hedge: int | None = None

    @classmethod
    def from_config(cls, g: int, config: CacheConfig, host: bool = False) -> CheckpointAdmission:
        """host: a host tier keeps what the device evicts; an unset checkpoint_interval is then
        HOST_INTERVAL (rounded up to the grid): mid-prompt states a re-rendered prompt resumes
        from are worth their bytes when the host holds them (kind rates evict them first on the
        device when they are not)."""
        hedge = config.checkpoint_hedge and -(-config.checkpoint_hedge // g) * g  # rounded up to the grid
        interval = config.checkpoint_interval or (-(-HOST_INTERVAL // g) * g if host else None)
        return cls(g, interval, config.checkpoint_chunk_ends, config.checkpoint_last_prompt,
                   config.checkpoint_branch_points, config.checkpoint_decode, config.checkpoint_decode_grid, hedge)

    def __post_init__(self):
        if self.granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {self.granularity}")
        for name in ("interval", "decode_grid", "hedge"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value % self.granularity):
                raise ValueError(f"{name} must be a positive multiple of granularity={self.granularity}, "
                                 f"got {value}")
        if self.chunk_ends not in CHUNK_ENDS:
            raise ValueError(f"chunk_ends must be one of {CHUNK_ENDS}, got {self.chunk_ends!r}")
        if self.last_prompt not in LAST_PROMPT:
            raise ValueError(f"last_prompt must be one of {LAST_PROMPT}, got {self.last_prompt!r}")
        if self.decode_mode not in DECODE:
            raise ValueError(f"decode_mode must be one of {DECODE}, got {self.decode_mode!r}")

    def floor(self, pos: int) -> int:
        """The G-position at or before pos."""
        return pos // self.granularity * self.granularity

    def prefill(self, start: int, end: int, prompt_len: int, branch_pos: int = 0,
                share_points: Iterable[int] = ()) -> dict[int, str]:
        """{position: kind} of the checkpoints to write while computing prompt tokens [start,
        end), positions in (start, end] in order. Kinds: "branch" (also `share_points`: where
        requests waiting for this one part from it), "interval", "last" (near the prompt's end),
        "hedge", "chunk"; a position several rules want has the first."""
        if not 0 <= start < end <= prompt_len:
            raise ValueError(f"need 0 <= start < end <= prompt_len, got start={start} end={end} "
                             f"prompt_len={prompt_len}")
        g, wanted = self.granularity, dict[int, str]()
        if self.branch_points:
            for pos in (branch_pos, *share_points):
                wanted.setdefault(pos, "branch")
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            wanted.update((p, "interval") for p in range(first, end + 1, self.interval) if p not in wanted)
        if self.last_prompt != "none":
            wanted.setdefault(self.floor(prompt_len - (self.last_prompt == "before-final")), "last")
        if self.hedge:
            wanted.setdefault(prompt_len // self.hedge * self.hedge, "hedge")
        if self.chunk_ends != "none" and end % g == 0:
            wanted.setdefault(end, "chunk")
        return {p: wanted[p] for p in sorted(wanted) if start < p <= end and p % g == 0}

    @property
    def transient_kind(self) -> str | None:
        """The kind whose checkpoints live only while their request runs: chunk ends under
        chunk_ends="transient" (the deepest one of a running request serves concurrent requests
        with its prefix and the request itself after a retraction)."""
        return "chunk" if self.chunk_ends == "transient" else None

    def decode(self, pos: int) -> DecodeCheckpoint:
        """Decision for the state after pos tokens, produced by a decode step."""
        if self.decode_kind(pos) == "interval":
            return DecodeCheckpoint.KEEP
        if pos % (self.decode_grid or self.granularity) or self.decode_mode == "none":
            return DecodeCheckpoint.NONE
        return DecodeCheckpoint.ROLLING if self.decode_mode == "rolling" else DecodeCheckpoint.KEEP

    def decode_kind(self, pos: int) -> str:
        """The kind of a decode checkpoint at pos: "interval" on the interval, else "decode"."""
        return "interval" if self.interval and pos % self.interval == 0 else "decode"

