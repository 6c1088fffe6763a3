"""Where checkpoints may go (the G grid) and which positions get one.

A position p means "the state after tokens [0, p)". Checkpoints sit only on multiples of
G = max(kernel chunk, page_size), so a resumed chunkwise kernel starts on a chunk boundary
and a checkpoint always ends on a page boundary of the KV it belongs to.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

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


class DecodeCheckpoint(enum.Enum):
    """What to do with the state a decode step just produced."""

    NONE = "none"
    ROLLING = "rolling"  # overwrite the request's one pending slot: the latest G-position wins
    KEEP = "keep"  # a checkpoint_interval position: keep it in its own slot


@dataclass(frozen=True)
class CheckpointAdmission:
    """Which positions get a checkpoint; each rule can be switched off (CacheConfig).

    Prefill admits: the end of a chunk that ends on the grid (every stashed middle chunk
    under G-aligned cuts, and a G-aligned prompt end) [chunk_ends]; the last G-position
    before the prompt's last token (an identical resend resumes there) [last_prompt]; the
    branch point found by match_prefix (future requests diverge there again)
    [branch_points]; every `interval` tokens.
    Decode keeps the latest G-position (rolling), so a finished request leaves the last
    G-position of prompt + output (the next turn of a conversation starts there) [decode],
    plus every `interval` tokens.
    """

    granularity: int
    interval: int | None = None
    chunk_ends: bool = True
    last_prompt: bool = True
    branch_points: bool = True
    decode_tail: bool = True

    @classmethod
    def from_config(cls, g: int, config: CacheConfig) -> CheckpointAdmission:
        return cls(g, config.checkpoint_interval, config.checkpoint_chunk_ends, config.checkpoint_last_prompt,
                   config.checkpoint_branch_points, config.checkpoint_decode)

    def __post_init__(self):
        if self.granularity < 1:
            raise ValueError(f"granularity must be >= 1, got {self.granularity}")
        if self.interval is not None and (self.interval < 1 or self.interval % self.granularity):
            raise ValueError(f"interval must be a positive multiple of granularity={self.granularity}, "
                             f"got {self.interval}")

    def floor(self, pos: int) -> int:
        """The G-position at or before pos."""
        return pos // self.granularity * self.granularity

    def prefill(self, start: int, end: int, prompt_len: int, branch_pos: int = 0) -> list[int]:
        """Sorted positions in (start, end] to checkpoint while computing prompt tokens [start, end)."""
        if not 0 <= start < end <= prompt_len:
            raise ValueError(f"need 0 <= start < end <= prompt_len, got start={start} end={end} "
                             f"prompt_len={prompt_len}")
        wanted = set()
        if self.last_prompt:
            wanted.add(self.floor(prompt_len - 1))
        if self.branch_points:
            wanted.add(branch_pos)
        if self.chunk_ends and end % self.granularity == 0:
            wanted.add(end)
        if self.interval:
            first = (start // self.interval + 1) * self.interval
            wanted.update(range(first, end + 1, self.interval))
        return sorted(p for p in wanted if start < p <= end and p % self.granularity == 0)

    def decode(self, pos: int) -> DecodeCheckpoint:
        """Decision for the state after pos tokens, produced by a decode step."""
        if pos % self.granularity:
            return DecodeCheckpoint.NONE
        if self.interval and pos % self.interval == 0:
            return DecodeCheckpoint.KEEP
        return DecodeCheckpoint.ROLLING if self.decode_tail else DecodeCheckpoint.NONE
