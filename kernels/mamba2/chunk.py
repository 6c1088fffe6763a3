"""Mamba2 SSD, chunkwise in torch (the CPU prefill path).

Each sequence is cut into chunks of `chunk_size` tokens counted from its own start (the last
chunk padded with dt = 0, which neither decays nor feeds the state). Inside a chunk the
output is a masked matmul with decays exp(segment sums); between chunks one loop carries the
state, batched over sequences. The chunk-entry states it keeps are the checkpoints.
Where the compiled CPU kernels are built (kernels/native.py), the same rule runs in
mamba2/cpu_ssd.cpp instead: one job per (sequence, group, block of heads), chunks in order,
states in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import native
from kernels.mamba2.varlen import locate_checkpoints, seq_bounds

CHUNK_SIZE = 128  # NemotronH's `chunk_size` (mamba_chunk_size) default


@dataclass(frozen=True)
class ChunkLayout:
    """Packed tokens regrouped as [NC, L] chunks, each inside one sequence."""

    index: torch.Tensor  # [NC * L] int64, packed token of each chunk slot (clamped on padding)
    valid: torch.Tensor  # [NC, L] bool, False on padding
    slot: torch.Tensor  # [T] int64, chunk slot of each packed token
    first: torch.Tensor  # [N] int64, index of each sequence's first chunk
    count: torch.Tensor  # [N] int64, chunks per sequence


def chunk_layout(cu: torch.Tensor, chunk_size: int) -> ChunkLayout:
    """Chunks of every sequence in cu [N+1], in sequence order."""
    lengths = cu[1:] - cu[:-1]  # [N]
    count = (lengths + chunk_size - 1) // chunk_size
    first = torch.cumsum(count, 0) - count
    seqs = torch.arange(len(count), device=cu.device)
    chunk_seq = torch.repeat_interleave(seqs, count)  # [NC]
    start = cu[chunk_seq] + (torch.arange(len(chunk_seq), device=cu.device) - first[chunk_seq]) * chunk_size
    index = start[:, None] + torch.arange(chunk_size, device=cu.device)  # [NC, L]
    valid = index < cu[chunk_seq + 1][:, None]
    token_seq = torch.repeat_interleave(seqs, lengths)  # [T]
    slot = first[token_seq] * chunk_size + torch.arange(len(token_seq), device=cu.device) - cu[token_seq]
    return ChunkLayout(index.clamp(max=max(int(cu[-1]) - 1, 0)).reshape(-1), valid, slot, first, count)


def segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    Summed directly over each range (a masked cumsum), not as a difference of prefix sums.
    """
    L = a.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, L).masked_fill(~strict, 0.0)  # [i, j] = a[i] if i > j
    sums = torch.cumsum(terms, dim=-2)
    upper = torch.ones(L, L, dtype=torch.bool, device=a.device).triu(1)
    return sums.masked_fill(upper, float("-inf"))


def chunk_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    checkpoint_at: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
):
    """Mamba2 SSD over packed varlen input; the recurrence is that of `naive_ssd`.

    x [T, H, P]; dt [T, H] (softplus'ed and clamped by the layer); A [H] (negative);
    B, C [T, G, S] with H % G == 0 (head h reads group h // (H / G)); D [H] or None: the skip
    D * x is added here, the z-gate is left to the gated norm after the kernel;
    initial_state [N, H, P, S] fp32 or None (zeros); cu_seqlens [N+1] int64 or None;
    checkpoint_at [C] packed positions whose offset in their sequence is a multiple of
    chunk_size or its end. Computation is fp32.
    Returns (y [T, H, P] in x.dtype, final_state [N, H, P, S] fp32 or None), plus
    states [C, H, P, S] fp32 when checkpoint_at is given.
    """
    T, H, P = x.shape
    G, S = B.shape[1:]
    R = H // G
    cu = seq_bounds(cu_seqlens, T, x.device)
    N = cu.numel() - 1
    check_ssd_args(x, dt, A, B, C, D, initial_state, N)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    compiled = _compiled(x, dt, A, B, C, D, initial_state, cu, checkpoint_at, chunk_size)
    if compiled is not None:
        out, final, states = compiled
        result = (out, final if output_final_state else None)
        return result if checkpoint_at is None else result + (states,)
    lay = chunk_layout(cu, chunk_size)
    NC, L = lay.valid.shape
    gather = lambda t: t.float().index_select(0, lay.index).view(NC, L, *t.shape[1:])  # noqa: E731
    xc = gather(x).view(NC, L, G, R, P)  # [NC, L, G, R, P]
    dtc = gather(dt) * lay.valid[..., None]  # [NC, L, H], 0 on padding
    Bc, Cc = gather(B), gather(C)  # [NC, L, G, S]

    a = (dtc * A.float()).transpose(1, 2)  # [NC, H, L]
    decay = torch.exp(segsum(a)).view(NC, G, R, L, L)  # [NC, G, R, L(i), L(j)]
    acum = torch.cumsum(a, dim=-1).view(NC, G, R, L)  # [NC, G, R, L]
    dtj = dtc.transpose(1, 2).reshape(NC, G, R, 1, L)

    # intra-chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_{j+1} + ... + a_i) dt_j x_j
    scores = torch.einsum("cigs,cjgs->cgij", Cc, Bc)[:, :, None] * decay * dtj  # [NC, G, R, L, L]
    y = torch.einsum("cgrij,cjgrp->cigrp", scores, xc)  # [NC, L, G, R, P]

    # each chunk's own contribution to the state at its end, from a zero start
    into_end = decay[..., -1, :] * dtj[..., 0, :]  # [NC, G, R, L]
    local = torch.einsum("cgrj,cjgs,cjgrp->cgrps", into_end, Bc, xc)  # [NC, G, R, P, S]
    total = torch.exp(acum[..., -1]).view(NC, H)  # [NC, H]

    entry, final = _pass_states(local.reshape(NC, H, P, S), total, lay, initial_state, N)

    # inter-chunk: y_i += exp(a_0 + ... + a_i) C_i . h_entry
    from_entry = torch.einsum("cigs,cgrps->cigrp", Cc, entry.view(NC, G, R, P, S))
    y = y + from_entry * torch.exp(acum).permute(0, 3, 1, 2)[..., None]

    out = y.reshape(NC * L, H, P).index_select(0, lay.slot)  # [T, H, P]
    if D is not None:
        out += D.float()[:, None] * x.float()
    result = (out.to(x.dtype), final if output_final_state else None)
    if checkpoint_at is None:
        return result
    where = locate_checkpoints(checkpoint_at, cu, multiple_of=chunk_size)
    at_end = where.offset == (cu[where.seq + 1] - cu[where.seq])
    chunk = (lay.first[where.seq] + where.offset // chunk_size).clamp(max=max(NC - 1, 0))  # entered at p
    at_chunk, at_final = entry.index_select(0, chunk), final.index_select(0, where.seq)
    return result + (torch.where(at_end[:, None, None, None], at_final, at_chunk),)


def _compiled(x, dt, A, B, C, D, initial_state, cu, checkpoint_at, chunk_size):
    """(y, final, states) from the compiled kernel, or None where it is not built."""
    _, H, P = x.shape
    N, S = cu.numel() - 1, B.shape[2]
    state = (x.new_zeros(N, H, P, S, dtype=torch.float32) if initial_state is None
             else initial_state.float().clone(memory_format=torch.contiguous_format))
    rows = torch.zeros(0, 2, dtype=torch.int64)
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu, multiple_of=chunk_size)
        rows = torch.stack([where.seq, where.offset], dim=1)
    out = native.chunk_ssd(x, dt, A, B, C, D, state, cu, rows, chunk_size)
    if out is None:
        return None
    y, states = out
    return y, state, states


def chunk_ssd_in_place(x, dt, A, B, C, D, state, slots, fresh, cu_seqlens, checkpoint_at=None, checkpoint_slots=None,
                       chunk_size: int = CHUNK_SIZE, out=None, gate=None):
    """chunk_ssd with each sequence's state a row of a pool, through the compiled kernel: state
    [rows, H, P, S] fp32, sequence n's initial state in row slots[n] (zeros where fresh[n]) advanced
    there in place to its final state, the state after each position of checkpoint_at written
    into row checkpoint_slots[i]. Returns y [T, H, P] in x's dtype (written into `out` where given:
    contiguous, of y's shape and dtype), or None where the kernel does not run (nothing is written
    then). With `gate` (native.chunk_ssd's), y comes back through the gated norm."""
    if state.dtype != torch.float32 or not state.is_contiguous():
        return None
    cu = seq_bounds(cu_seqlens, x.shape[0], x.device)
    rows, at = torch.zeros(0, 2, dtype=torch.int64), native.EMPTY
    if checkpoint_at is not None:
        where = locate_checkpoints(checkpoint_at, cu, multiple_of=chunk_size)
        rows, at = torch.stack([where.seq, where.offset], dim=1), checkpoint_slots
    into = native.out_rows(out, x.shape, x.dtype)
    y = native.chunk_ssd(x, dt, A, B, C, D, state, cu, rows, chunk_size, slots, fresh, at, into, gate=gate)
    return None if y is None else y[0]


def _pass_states(local, total, lay: ChunkLayout, initial_state, N):
    """Carry the state across chunks: one step per chunk index, batched over sequences.

    local [NC, H, P, S]; total [NC, H] decay over each chunk. Returns (entry [NC, H, P, S],
    the state before each chunk; final [N, H, P, S], the state after each sequence).
    """
    NC, H, P, S = local.shape
    if initial_state is None:
        h = local.new_zeros(N, H, P, S)
    else:
        h = initial_state.to(device=local.device, dtype=torch.float32, copy=True)
    entry = torch.empty_like(local)
    for k in range(int(lay.count.max()) if N else 0):
        seqs = (lay.count > k).nonzero().squeeze(1)  # sequences that have a chunk k
        c = lay.first[seqs] + k
        hk = h.index_select(0, seqs)
        entry.index_copy_(0, c, hk)
        hk = total.index_select(0, c)[..., None, None] * hk + local.index_select(0, c)
        h.index_copy_(0, seqs, hk)
    return entry, h


def check_ssd_args(x, dt, A, B, C, D, initial_state, N):
    """ValueError naming the first argument whose shape does not fit x [T, H, P]."""
    T, H, P = x.shape
    if dt.shape != (T, H):
        raise ValueError(f"dt must be [T, H] = {(T, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = {(H,)}, got {tuple(A.shape)}")
    if B.dim() != 3 or B.shape[0] != T or H % B.shape[1] != 0:
        raise ValueError(f"B must be [T, G, S] with H % G == 0, got {tuple(B.shape)} for H={H}")
    if C.shape != B.shape:
        raise ValueError(f"C must match B {tuple(B.shape)}, got {tuple(C.shape)}")
    if D is not None and D.shape != (H,):
        raise ValueError(f"D must be [H] = {(H,)} or None, got {tuple(D.shape)}")
    if initial_state is not None and initial_state.shape != (N, H, P, B.shape[2]):
        raise ValueError(
            f"initial_state must be [N, H, P, S] = {(N, H, P, B.shape[2])}, got {tuple(initial_state.shape)}"
        )
