"""ForwardBatch: what a model forward consumes.

Prefill-only, decode-only and mixed batches are one type: a list of segments, each the
range [prefix_len, prefix_len + len) of one sequence. Segments are packed in order; the
trailing one-token segments without checkpoints are the decode rows (`num_decodes`), run
by the recurrent step kernels. The batch carries the memory it runs on as plain tensors
(per-layer KV page buffers, per-layer state-slot buffers), so models never import pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from kernels.attention import PAD_PAGE


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


# whether layers run a decode-only batch's rows through their one-call compiled bodies
# (kernels/native.py delta_decode, mamba_decode, attention_decode, mla_decode); False: kernel by
# kernel (the tests compare the two)
FUSED_DECODE = True


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
    every_token: bool = False  # logits_at is every token in order (a decode-only step): no gather

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

    @property
    def fused_decode(self) -> bool:
        """Every row a decode row on this one rank, with FUSED_DECODE: the layers may run their
        compiled one-call decode bodies (each returns None where its kernels would not run)."""
        return FUSED_DECODE and self.num_decodes == len(self.segments) and self.cp is None

    @classmethod
    def build(
        cls, segments: Sequence[Segment], memory: Memory, device="cpu", all_logits: bool = False,
        logits_for: Sequence[int] | None = None,
    ) -> "ForwardBatch":
        """Flatten segments into tensors. Logits: at the last token of the segments listed in
        `logits_for` (default: every segment), or at every token with `all_logits`."""
        if not segments:
            raise ValueError("segments: a batch needs at least one segment")
        ps, n = memory.page_size, len(segments)
        lens = np.fromiter((len(s.input_ids) for s in segments), np.int64, n)
        if lens.min() < 1:
            raise ValueError("segments: every segment needs at least one token")
        num_decodes = 0
        for s in reversed(segments):
            if len(s.input_ids) != 1 or s.checkpoints or s.prefix_len == 0:
                break
            num_decodes += 1
        prefix = np.fromiter((s.prefix_len for s in segments), np.int64, n)
        cu = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        ends = prefix + lens
        held = np.fromiter((len(s.pages) for s in segments), np.int64, n)
        if (short := np.flatnonzero(held * ps < ends)).size:
            i = short[0]
            raise ValueError(f"segments: {held[i]} pages of {ps} cannot hold {ends[i]} tokens")
        ck_at, ck_slots = [], []
        for i, s in enumerate(segments):
            for p, slot in s.checkpoints:
                if not s.prefix_len < p <= ends[i]:
                    raise ValueError(f"segments: checkpoint at {p} outside ({s.prefix_len}, {ends[i]}]")
                ck_at.append(cu[i] + p - s.prefix_len)
                ck_slots.append(slot)
        # the tables in numpy and each index computed at once: a decode step's batch is 64 rows of
        # ~85 pages, and building it op by op in torch took ~0.5 ms of a ~10 ms step
        table = np.full((n, held.max()), PAD_PAGE, dtype=np.int64)
        table[np.arange(table.shape[1]) < held[:, None]] = np.fromiter(
            chain.from_iterable(s.pages for s in segments), np.int64, held.sum())  # row by row, in order
        seg = np.repeat(np.arange(n), lens)  # [T] segment of each token
        positions = np.arange(cu[-1]) - cu[seg] + prefix[seg]
        wanted = range(n) if logits_for is None else logits_for
        logits_at = np.arange(cu[-1]) if all_logits else cu[1:][np.asarray(list(wanted), dtype=np.int64)] - 1
        ids = np.fromiter(chain.from_iterable(s.input_ids for s in segments), np.int64, cu[-1])

        def t(x):
            return torch.from_numpy(np.asarray(x, dtype=np.int64)).to(device)

        return cls(
            segments=list(segments),
            input_ids=t(ids),
            positions=t(positions),
            cu_seqlens=t(cu),
            prefix_lens=t(prefix),
            seq_lens=t(ends),
            state_slots=t([s.state_slot for s in segments]),
            page_table=t(table),
            kv_slots=t(table[seg, positions // ps] * ps + positions % ps),  # as kernels/attention slot_mapping
            checkpoint_at=t(ck_at),
            checkpoint_slots=t(ck_slots),
            logits_at=t(logits_at),
            num_decodes=num_decodes,
            memory=memory,
            every_token=bool(logits_at.size == cu[-1] and (logits_at == np.arange(cu[-1])).all()),
        )
