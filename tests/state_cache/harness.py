"""A toy engine that drives the cache the way the real one does, with fake layer math.

Per token it writes a KV entry that identifies the prefix it ends (exact in fp64) and
advances a recurrent state: an fp32 tensor that no lower precision could reproduce,
plus a bf16 conv tail. A run from a restored checkpoint must end in the state a run from
scratch ends in, bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from state_cache import (
    CheckpointAdmission,
    DecodeCheckpoint,
    KVPool,
    MatchResult,
    StatePool,
    StateRadixCache,
)

KV_LAYERS = [{"kv": (1, 2)}]
STATE_LAYERS = [{"recurrent": ((2, 3, 3), torch.float32), "conv": ((4, 3), torch.bfloat16)}]


def make_cache(page_size: int, chunk: int, num_tokens: int = 4096, num_checkpoints: int = 32,
               tensors: bool = True, **kwargs) -> StateRadixCache:
    device = "cpu" if tensors else None
    kv = KVPool(num_tokens // page_size, page_size, KV_LAYERS, torch.float64, device)
    st = StatePool(4, num_checkpoints, STATE_LAYERS, device)
    return StateRadixCache(kv, st, {"kda": chunk}, **kwargs)


def kv_entry(tokens: Sequence[int], pos: int) -> float:
    """The KV value of the token at pos: a hash of tokens[:pos + 1], exact in fp64."""
    h = 0
    for t in tokens[: pos + 1]:
        h = (h * 1_000_003 + int(t) + 1) % (1 << 40)
    return float(h)


def step_state(state: dict[str, torch.Tensor], token: int) -> None:
    """Advance one token in place (fp32 recurrent, bf16 conv tail)."""
    rec, conv = state["recurrent"], state["conv"]
    ramp = torch.arange(1, rec.numel() + 1, dtype=torch.float32).view_as(rec)
    rec.mul_(0.7071).add_(torch.sin(ramp * (token + 1) * 0.377))
    conv.copy_(torch.roll(conv, -1, dims=-1))
    conv[:, -1] = torch.cos(torch.arange(4, dtype=torch.float32) * (token + 1)).to(conv.dtype)


def reference_state(tokens: Sequence[int]) -> dict[str, torch.Tensor]:
    """The state after tokens, computed from scratch."""
    state = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in STATE_LAYERS[0].items()}
    for t in tokens:
        step_state(state, t)
    return state


class RunResult(NamedTuple):
    match: MatchResult
    state: dict[str, torch.Tensor] | None  # after prompt + output[:-1]; None without tensors
    computed: int  # tokens the run computed (not resumed from the cache)


class ToyEngine:
    """Runs one request at a time: match, lock, restore, chunked prefill with stashes, decode, finish.

    On pools without tensors it makes the same cache calls and skips the layer math.
    """

    def __init__(self, cache: StateRadixCache, chunk: int | None = None, interval: int | None = None):
        self.cache = cache
        self.admission = CheckpointAdmission(cache.granularity, interval)
        self.chunk = chunk  # prefill chunk (a multiple of G); None: one shot

    def run(self, prompt: Sequence[int], output: Sequence[int]) -> RunResult:
        cache, st = self.cache, self.cache.state_pool
        if not output:
            raise ValueError("output: need at least one sampled token")
        seq = list(prompt) + list(output)
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        locked, pages = m.node, list(m.pages)
        slot = st.alloc_active()
        if m.checkpoint is not None:
            cache.restore(m.checkpoint, slot)
        self._check_kv(seq, pages, m.state_len)
        pos, computed = m.state_len, 0
        while pos < len(prompt):  # prefill rounds; each one is stashed
            end = len(prompt) if self.chunk is None else min(pos + self.chunk, len(prompt))
            want = self.admission.prefill(pos, end, len(prompt), m.branch_pos)
            ckpts = self._compute(seq, pos, end, slot, pages, dict.fromkeys(want, DecodeCheckpoint.KEEP))
            res = cache.insert(seq[:end], pages, ckpts)
            pages[: len(res.pages)] = res.pages
            cache.lock(res.node)
            cache.unlock(locked)
            locked, computed, pos = res.node, computed + end - pos, end
        decode = {p: self.admission.decode(p) for p in range(len(prompt) + 1, len(seq))}
        ckpts = self._compute(seq, len(prompt), len(seq) - 1, slot, pages, decode)  # output[:-1]
        res = cache.insert(seq[: len(seq) - 1], pages, ckpts)
        cache.kv_pool.free(pages[len(res.pages):])
        cache.unlock(locked)
        state = {name: buf[slot].clone() for name, buf in st.buffers[0].items()} if st.buffers else None
        st.free(slot)
        return RunResult(m, state, computed + len(seq) - 1 - len(prompt))

    def _compute(self, seq, start, end, slot, pages, want: dict[int, DecodeCheckpoint]) -> dict[int, int]:
        """Compute tokens [start, end): write KV, advance the state, save it at the wanted positions.

        A ROLLING position reuses the slot of the previous one (still writable: not inserted yet).
        """
        cache, ps = self.cache, self.cache.page_size
        need = -(-end // ps) - len(pages)
        if need > 0:
            new = cache.alloc_pages(need)
            assert new is not None, "toy engine: out of KV pages"
            pages += new
        tensors = bool(cache.state_pool.buffers)
        saved, rolling = {}, None
        for i in range(start, end):
            if tensors:
                cache.kv_pool.buffers[0]["kv"][pages[i // ps], i % ps] = kv_entry(seq, i)
                step_state({name: buf[slot] for name, buf in cache.state_pool.buffers[0].items()}, seq[i])
            kind = want.get(i + 1, DecodeCheckpoint.NONE)
            if kind is DecodeCheckpoint.NONE:
                continue
            ck = saved.pop(rolling) if kind is DecodeCheckpoint.ROLLING and rolling else cache.alloc_checkpoint()
            if ck is None:
                continue
            cache.state_pool.save(slot, ck)
            saved[i + 1] = ck
            rolling = i + 1 if kind is DecodeCheckpoint.ROLLING else rolling
        return saved

    def _check_kv(self, seq, pages, upto: int) -> None:
        if not self.cache.kv_pool.buffers:
            return
        kv, ps = self.cache.kv_pool.buffers[0]["kv"], self.cache.page_size
        for i in range(upto):
            got = kv[pages[i // ps], i % ps, 0, 0].item()
            assert got == kv_entry(seq, i), f"KV of position {i} in page {pages[i // ps]} is stale"
