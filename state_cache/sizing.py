"""Sizing the pools from the layer specs and a memory budget (`--mem-fraction` style).

    unified (default)  budget = active slots + staging rows (fixed) + one pool of KV pages;
                       checkpoints are carved from those pages on demand (whole pages each)
    static split       budget = active slots + checkpoint slots + KV pages: checkpoint slots
                       get `checkpoint_share` of what the active slots leave, KV pages the rest
    host tier          host_bytes of pages of the same layout in host memory, for both kinds
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from state_cache.kv_pool import KVLayerSpec, KVPool, kv_bytes_per_token
from state_cache.state_pool import StateLayerSpec, StatePool, state_bytes_per_slot


@dataclass(frozen=True)
class MemoryPlan:
    """How many pages and slots a budget buys; sizes in bytes. num_checkpoints: checkpoint
    slots of the static split, or under the unified budget the staging rows a forward writes
    new checkpoints into (the checkpoints themselves live in KV pages)."""

    budget_bytes: int
    page_size: int
    num_pages: int
    num_active: int
    num_checkpoints: int
    bytes_per_token: int
    bytes_per_slot: int
    unified: bool = False
    host_pages: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token

    @property
    def active_bytes(self) -> int:
        return self.num_active * self.bytes_per_slot

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.bytes_per_slot

    @property
    def pages_per_checkpoint(self) -> int:
        return -(-self.bytes_per_slot // (self.page_size * self.bytes_per_token))

    @property
    def host_bytes(self) -> int:
        return self.host_pages * self.page_size * self.bytes_per_token

    def report(self) -> str:
        """A human-readable account of the plan."""
        used = self.kv_bytes + self.active_bytes + self.checkpoint_bytes
        page = self.page_size * self.bytes_per_token
        lines = [
            f"memory plan: budget {_fmt(self.budget_bytes)}, used {_fmt(used)}",
            f"  active slots: {self.num_active} x {_fmt(self.bytes_per_slot)} = {_fmt(self.active_bytes)}",
        ]
        if self.unified:
            k = self.pages_per_checkpoint
            lines += [
                f"  staging rows: {self.num_checkpoints} x {_fmt(self.bytes_per_slot)} = {_fmt(self.checkpoint_bytes)}"
                " (new checkpoints, until the cache stores them in pages)",
                f"  one budget:   {self.num_pages} pages x {_fmt(page)} = {_fmt(self.kv_bytes)}, shared on demand by",
                f"                KV ({self.page_size} tokens x {_fmt(self.bytes_per_token)}/token a page; "
                f"{self.num_pages * self.page_size} tokens if all KV)",
                f"                and checkpoints ({k} pages each; {self.num_pages // k} if all checkpoints)",
            ]
        else:
            lines += [
                f"  checkpoints:  {self.num_checkpoints} x {_fmt(self.bytes_per_slot)} = {_fmt(self.checkpoint_bytes)}",
                f"  KV pages:     {self.num_pages} x {self.page_size} tokens x {_fmt(self.bytes_per_token)}/token"
                f" = {_fmt(self.kv_bytes)} ({self.num_pages * self.page_size} tokens)",
            ]
        if self.host_pages:
            lines.append(f"  host tier:    {self.host_pages} pages = {_fmt(self.host_bytes)} for evicted KV and "
                         f"checkpoints ({self.host_pages * self.page_size} tokens or "
                         f"{self.host_pages // self.pages_per_checkpoint} checkpoints)")
        lines.append(f"  one checkpoint holds as many bytes as {self.bytes_per_slot / max(self.bytes_per_token, 1):.0f}"
                     " KV tokens")
        return "\n".join(lines)


def plan_memory(
    kv_layers: Sequence[KVLayerSpec],
    state_layers: Sequence[StateLayerSpec],
    *,
    budget_bytes: int,
    page_size: int,
    max_running: int,
    checkpoint_share: float | None = None,
    staging_rows: int = 8,
    host_bytes: int = 0,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> MemoryPlan:
    """Split budget_bytes into max_running active slots and, with checkpoint_share None (the
    unified budget), staging rows (staging_rows, at most max_running) plus one pool of pages
    for KV and checkpoints; with a share, checkpoint slots (that share of the rest) and KV
    pages. host_bytes: the host tier."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if checkpoint_share is not None and not 0.0 <= checkpoint_share <= 1.0:
        raise ValueError(f"checkpoint_share must be in [0, 1] or unset, got {checkpoint_share}")
    if staging_rows < 0 or host_bytes < 0:
        raise ValueError(f"staging_rows and host_bytes must be >= 0, got {staging_rows} and {host_bytes}")
    per_token = kv_bytes_per_token(kv_layers, kv_dtype)
    per_slot = state_bytes_per_slot(state_layers)
    if per_token == 0:
        raise ValueError("kv_layers: no attention KV to size pages from")
    if per_slot == 0:
        raise ValueError("state_layers: no linear-layer state to size slots from")
    staging_rows = min(staging_rows, max_running)
    fixed = max_running + (staging_rows if checkpoint_share is None else 0)
    rest = budget_bytes - fixed * per_slot
    if rest < 0:
        raise ValueError(
            f"budget_bytes={budget_bytes} does not hold the {fixed} active and staging slots "
            f"of {per_slot} bytes (max_running)"
        )
    page = per_token * page_size
    host_pages = host_bytes // page
    if checkpoint_share is None:
        return MemoryPlan(budget_bytes, page_size, rest // page, max_running, staging_rows, per_token, per_slot,
                          unified=True, host_pages=host_pages)
    num_ckpts = int(rest * checkpoint_share) // per_slot
    num_pages = (rest - num_ckpts * per_slot) // page
    return MemoryPlan(budget_bytes, page_size, num_pages, max_running, num_ckpts, per_token, per_slot,
                      host_pages=host_pages)


def make_pools(
    plan: MemoryPlan,
    kv_layers: Sequence[KVLayerSpec],
    state_layers: Sequence[StateLayerSpec],
    kv_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> tuple[KVPool, StatePool]:
    """The pools a plan describes (device=None: pools that only count); under the unified
    budget the state pool stores checkpoints in the KV pool's pages."""
    kv = KVPool(plan.num_pages, plan.page_size, kv_layers, kv_dtype, device)
    state = StatePool(plan.num_active, plan.num_checkpoints, state_layers, device, arena=kv if plan.unified else None)
    return kv, state


def make_host_pool(plan: MemoryPlan, kv_layers: Sequence[KVLayerSpec], kv_dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str | None = None) -> KVPool | None:
    """The plan's host tier: pages of the KV pool's layout in host memory (pinned when the
    device is a GPU, so copies run at the link's speed); None without one."""
    if not plan.host_pages:
        return None
    if device is None:
        return KVPool(plan.host_pages, plan.page_size, kv_layers, kv_dtype)
    pinned = torch.device(device).type == "cuda"
    return KVPool(plan.host_pages, plan.page_size, kv_layers, kv_dtype, "cpu", pin_memory=pinned)


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
