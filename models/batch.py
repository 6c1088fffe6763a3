"""ForwardBatch: what a model forward consumes.

Prefill-only, decode-only and mixed batches are one type: a list of segments, each the
range [prefix_len, prefix_len + len) of one sequence. Segments are packed in order; the
trailing one-token segments without checkpoints are the decode rows (`num_decodes`), run
by the recurrent step kernels. The batch carries the memory it runs on as plain tensors
(per-layer KV page buffers, per-layer state-slot buffers), so models never import pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from kernels.attention import PAD_PAGE, slot_mapping


class Segment(NamedTuple):
    """One sequence's share of a batch.

    input_ids: the tokens computed now, at positions prefix_len .. prefix_len+len-1.
    prefix_len: tokens whose KV (in `pages`) and state (in `state_slot`) are final.
    pages: KV page ids covering at least prefix_len + len(input_ids) tokens.
    checkpoints: (position, checkpoint slot) pairs: after the forward, the slot holds the
      linear-layer states after tokens < position (prefix_len < position <= end; position -
      prefix_len a multiple of the kernel chunk, or the segment end).
    owner: opaque handle of the caller (a request); models ignore it.
    """

    input_ids: Sequence[int]
    prefix_len: int
    state_slot: int
    pages: Sequence[int]
    checkpoints: Sequence[tuple[int, int]] = ()
    owner: Any = None


@dataclass
class Memory:
    """Views of the pools a batch runs on (plain tensors, owned by the caller)."""

    kv: list[dict[str, torch.Tensor]]  # per attn layer: name -> [num_pages, page_size, *shape]
    state: list[dict[str, torch.Tensor]]  # per linear layer: name -> [num_slots, *shape]
    page_size: int


@dataclass
class ForwardBatch:
    segments: list[Segment]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its sequence
    cu_seqlens: torch.Tensor  # [N+1] packed offsets
    prefix_lens: torch.Tensor  # [N]
    seq_lens: torch.Tensor  # [N] prefix_len + segment length
    state_slots: torch.Tensor  # [N]
    page_table: torch.Tensor  # [N, P] (padded with PAD_PAGE)
    kv_slots: torch.Tensor  # [T] flat KV slot (page * page_size + offset) of each new token
    checkpoint_at: torch.Tensor  # [C] packed positions (see Segment.checkpoints)
    checkpoint_slots: torch.Tensor  # [C]
    logits_at: torch.Tensor  # [L] packed indices whose logits the forward returns
    num_decodes: int
    memory: Memory
    extras: dict = field(default_factory=dict)  # per-forward caches models may fill
    cp: Any = None  # ContextParallel (models/layers/context_parallel.py) when ranks share one segment

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the prefill segments (they come first in the packing)."""
        return self.num_tokens - self.num_decodes

    @property
    def num_prefills(self) -> int:
        return len(self.segments) - self.num_decodes

    @classmethod
    def build(
        cls, segments: Sequence[Segment], memory: Memory, device="cpu", all_logits: bool = False,
        logits_for: Sequence[int] | None = None,
    ) -> "ForwardBatch":
        """Flatten segments into tensors. Logits: at the last token of the segments listed in
        `logits_for` (default: every segment), or at every token with `all_logits`."""
        if not segments:
            raise ValueError("segments: a batch needs at least one segment")
        ps = memory.page_size
        lens = [len(s.input_ids) for s in segments]
        if min(lens) < 1:
            raise ValueError("segments: every segment needs at least one token")
        num_decodes = 0
        for s in reversed(segments):
            if len(s.input_ids) != 1 or s.checkpoints or s.prefix_len == 0:
                break
            num_decodes += 1
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ck_at, ck_slots = [], []
        for s, start, n in zip(segments, cu, lens):
            end = s.prefix_len + n
            if len(s.pages) * ps < end:
                raise ValueError(f"segments: {len(s.pages)} pages of {ps} cannot hold {end} tokens")
            for p, slot in s.checkpoints:
                if not s.prefix_len < p <= end:
                    raise ValueError(f"segments: checkpoint at {p} outside ({s.prefix_len}, {end}]")
                ck_at.append(start + p - s.prefix_len)
                ck_slots.append(slot)
        width = max(len(s.pages) for s in segments)
        # filled row by row in numpy: torch.tensor of the padded lists took ~0.3 ms at 64 rows of 82
        # pages, a decode step's (0.1 ms so)
        table = np.full((len(segments), width), PAD_PAGE, dtype=np.int64)
        for i, s in enumerate(segments):
            table[i, : len(s.pages)] = s.pages
        wanted = range(len(segments)) if logits_for is None else logits_for
        logits_at = list(range(cu[-1])) if all_logits else [cu[i + 1] - 1 for i in wanted]

        def t(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        cu_seqlens, prefix_lens = t(cu), t([s.prefix_len for s in segments])
        page_table = torch.from_numpy(table).to(device)
        seq_lens = prefix_lens + t(lens)
        seg = torch.repeat_interleave(torch.arange(len(segments), device=device), t(lens))  # [T]
        return cls(
            segments=list(segments),
            input_ids=t([i for s in segments for i in s.input_ids]),
            positions=torch.arange(cu[-1], device=device) - cu_seqlens[seg] + prefix_lens[seg],
            cu_seqlens=cu_seqlens,
            prefix_lens=prefix_lens,
            seq_lens=seq_lens,
            state_slots=t([s.state_slot for s in segments]),
            page_table=page_table,
            kv_slots=slot_mapping(page_table, cu_seqlens, seq_lens, ps),
            checkpoint_at=t(ck_at),
            checkpoint_slots=t(ck_slots),
            logits_at=t(logits_at),
            num_decodes=num_decodes,
            memory=memory,
        )
