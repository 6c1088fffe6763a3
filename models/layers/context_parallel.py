"""Context-parallel prefill: one prefill segment split across the ranks of a process group.

Rank r computes tokens [bounds[r], bounds[r+1]) of the segment through every layer. Token-wise
layers (projections, norms, MLPs, MoE) need nothing; the others exchange:

- attention: every rank all-gathers the segment's new K/V and writes all of it into its own
  pages (the KV is replicated), then attends with its queries over prefix + keys up to its end;
- short conv: a rank's initial conv state is the last W-1 inputs of the rank before it;
- delta rule (KDA, GDN) and Mamba2 SSD: the recurrence is affine in the initial state,
  S_end = M S_in + S_local, out_t = out_local_t + (correction linear in S_in). Each rank runs
  its slice once from a zero state (rank 0 from the segment's true state), all ranks
  all-gather (S_local, M), each composes the true initial state of its slice (a scan over
  ranks) and corrects its outputs and checkpoint states; every rank ends with the segment's
  final state in its slot.

For the delta rule M [HV, K, K] and the correction come out of the same kernel call: the
values are widened to [v | 0] and the initial state to [S0 | I], so the extra K columns carry
the transition (final state) and scale * q_t^T P_t (outputs, P_t the transition up to t);
the correction is then one matmul with S_in. For Mamba2 the transition is a scalar decay per
head, exp(sum dt * A), and the correction exp(cumsum) * C_t S_in.

Slices are cut at multiples of `align` (the checkpoint grid G), so each rank's checkpoints sit
on its local kernel-chunk grid and every slice is longer than a conv window.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from kernels.attention import slot_mapping, write_kv
from models.batch import ForwardBatch, Memory, Segment


@dataclass(frozen=True)
class ContextParallel:
    """This rank's share of one prefill segment split across `group`."""

    group: Any  # torch.distributed ProcessGroup (None: the default group)
    rank: int
    world: int
    bounds: tuple[int, ...]  # [world + 1] token offsets of the ranks' slices in the segment
    prefix_len: int  # the segment's prefix (tokens already final before it)
    kv_slots: torch.Tensor  # [T_segment] KV slots of every token of the segment
    checkpoint_slots: tuple[tuple[int, ...], ...]  # per rank: checkpoint slots its slice writes

    @property
    def slice_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape on every rank), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T_local, ...] on every rank -> [T_segment, ...] (the slices in order)."""
        width = max(self.slice_lens)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = self.all_gather(padded)
        return torch.cat([p[:n] for p, n in zip(parts, self.slice_lens)])

    def scan(self, local: torch.Tensor, trans: torch.Tensor, apply: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """(initial state of this rank's slice, final state of the segment) from every rank's
        (local, trans): s_0 = 0, s_{r+1} = apply(trans_r, s_r) + local_r. Rank 0's `local`
        already contains the segment's initial state."""
        locals_, transs = self.all_gather(local), self.all_gather(trans)
        s = s_in = torch.zeros_like(local)
        for r in range(self.world):
            if r == self.rank:
                s_in = s
            s = apply(transs[r], s) + locals_[r]
        return s_in, s

    def share_checkpoints(self, state: torch.Tensor) -> None:
        """Copy each rank's checkpoint slots of `state` to every rank (the pools are replicated)."""
        for r, slots in enumerate(self.checkpoint_slots):
            if slots:
                idx = torch.tensor(slots, device=state.device)
                rows = state[idx].contiguous()
                dist.broadcast(rows, dist.get_global_rank(self.group, r) if self.group else r, group=self.group)
                state[idx] = rows


def split_bounds(num_tokens: int, world: int, align: int) -> tuple[int, ...]:
    """Offsets [world + 1] cutting num_tokens into `world` slices of about equal length, each
    a multiple of `align` except the last. Raises ValueError if a slice would be empty."""
    if num_tokens < world * align:
        raise ValueError(f"context parallel: {num_tokens} tokens cannot give {world} slices of >= {align}")
    cuts = [round(num_tokens * r / world / align) * align for r in range(world)]
    return (*cuts, num_tokens)


def context_parallel_batch(segment: Segment, memory: Memory, group=None, align: int = 64, device="cpu",
                           all_logits: bool = False) -> ForwardBatch:
    """This rank's batch for one prefill `segment` split across `group` (every rank passes the
    same segment, with the same pages and slots in its own replica of the pools). Logits: at
    this rank's tokens with `all_logits`, else at its last token (the segment's last token on
    the last rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = len(segment.input_ids)
    bounds = split_bounds(n, world, align)
    a, b = bounds[rank], bounds[rank + 1]
    p0 = segment.prefix_len
    owned = [[(p, s) for p, s in segment.checkpoints if p0 + lo < p <= p0 + hi] for lo, hi in zip(bounds, bounds[1:])]
    local = Segment(segment.input_ids[a:b], p0 + a, segment.state_slot, segment.pages, owned[rank], segment.owner)
    batch = ForwardBatch.build([local], memory, device=device, all_logits=all_logits)
    table = batch.page_table
    cu = torch.tensor([0, n], device=table.device)
    batch.cp = ContextParallel(
        group=group, rank=rank, world=world, bounds=bounds, prefix_len=p0,
        kv_slots=slot_mapping(table, cu, torch.tensor([p0 + n], device=table.device), memory.page_size),
        checkpoint_slots=tuple(tuple(s for _, s in o) for o in owned),
    )
    return batch


# ---- the layers' context-parallel prefills: (cp, rows, init [1, ...], checkpoint_at) -> (out, final, [states]) ----

def delta_rule_prefill(cp: ContextParallel, chunk: Callable, q, k, v, g, beta, init, ck):
    """KDA / GDN (`chunk` the prefill kernel; q, k [T, H, K], v [T, HV, V] fp32, init [1, HV, K, V])."""
    t, hv, v_dim = v.shape
    k_dim = q.shape[-1]
    eye = torch.eye(k_dim, device=v.device).expand(1, hv, k_dim, k_dim)
    s0 = torch.cat([init.float() if cp.rank == 0 else torch.zeros_like(init, dtype=torch.float32), eye], -1)
    wide = torch.cat([v, v.new_zeros(t, hv, k_dim)], -1)  # [T, HV, V + K]
    cu = torch.tensor([0, t], device=v.device)
    o, fin, *states = chunk(q, k, wide, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                            checkpoint_at=ck)
    s_in, final = cp.scan(fin[..., :v_dim], fin[..., v_dim:], torch.matmul)  # [1, HV, K, V] each
    out = o[..., :v_dim] + torch.einsum("thk,hkv->thv", o[..., v_dim:].float(), s_in[0]).to(o.dtype)
    if ck is None:
        return out, final
    return out, final, states[0][..., :v_dim] + states[0][..., v_dim:] @ s_in


def ssd_prefill(cp: ContextParallel, chunk: Callable, x, dt, A, B, C, D, init, ck, chunk_size: int):
    """Mamba2 SSD (x [T, H, P] fp32, dt [T, H], A [H], B, C [T, G, S], init [1, H, P, S])."""
    t, h, _ = x.shape
    s0 = init.float() if cp.rank == 0 else torch.zeros_like(init, dtype=torch.float32)
    cu = torch.tensor([0, t], device=x.device)
    y, fin, *states = chunk(x, dt, A, B, C, D, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                            checkpoint_at=ck, chunk_size=chunk_size)
    log_decay = torch.cumsum(dt.float() * A.float(), 0)  # [T, H]: through token t
    s_in, final = cp.scan(fin, log_decay[-1].exp(), lambda a, s: a[:, None, None] * s)  # [1, H, P, S]
    heads_per_group = h // C.shape[1]
    c = C.float().repeat_interleave(heads_per_group, 1)  # [T, H, S]
    y = y + (log_decay.exp()[..., None] * torch.einsum("hps,ths->thp", s_in[0], c)).to(y.dtype)
    if ck is None:
        return y, final
    return y, final, states[0] + log_decay[ck - 1].exp()[:, :, None, None] * s_in


def conv_prefill(cp: ContextParallel, conv: Callable, x, weight, bias, activation, init, ck):
    """Causal depthwise conv (x [T, D], weight [D, W], init [1, D, W-1]): a slice's initial state
    is the previous slice's last W-1 inputs (slices are longer than W-1)."""
    w = weight.shape[1]
    tails = cp.all_gather(x[x.shape[0] - (w - 1):].t().to(init.dtype)[None])  # [1, D, W-1] per rank
    s_in = init if cp.rank == 0 else tails[cp.rank - 1]
    cu = torch.tensor([0, x.shape[0]], device=x.device)
    y, _, *states = conv(x, weight, bias, s_in, cu_seqlens=cu, activation=activation, checkpoint_at=ck)
    return (y, tails[-1], *states)


def store_kv(batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor | None, k: torch.Tensor,
             v: torch.Tensor | None = None) -> None:
    """Write a batch's new K (and V) into the pages; under context parallelism every rank
    writes the whole segment's (gathered from all ranks)."""
    cp = batch.cp
    if cp is None:
        write_kv(k_cache, v_cache, batch.kv_slots, k, v)
        return
    write_kv(k_cache, v_cache, cp.kv_slots, cp.gather_tokens(k), None if v is None else cp.gather_tokens(v))
