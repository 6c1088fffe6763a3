"""Sizing the pools from the layer specs and a memory budget (`--mem-fraction` style).

    budget = active slots (max_running, fixed) + checkpoint slots + KV pages
             checkpoint slots get `checkpoint_share` of what the active slots leave,
             KV pages the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from state_cache.kv_pool import KVLayerSpec, KVPool, kv_bytes_per_token
from state_cache.state_pool import StateLayerSpec, StatePool, state_bytes_per_slot


@dataclass(frozen=True)
class MemoryPlan:
    """How many pages and slots a budget buys; sizes in bytes."""

    budget_bytes: int
    page_size: int
    num_pages: int
    num_active: int
    num_checkpoints: int
    bytes_per_token: int
    bytes_per_slot: int

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token

    @property
    def active_bytes(self) -> int:
        return self.num_active * self.bytes_per_slot

    @property
    def checkpoint_bytes(self) -> int:
        return self.num_checkpoints * self.bytes_per_slot

    def report(self) -> str:
        """A human-readable account of the split."""
        used = self.kv_bytes + self.active_bytes + self.checkpoint_bytes
        return "\n".join([
            f"memory plan: budget {_fmt(self.budget_bytes)}, used {_fmt(used)}",
            f"  active slots: {self.num_active} x {_fmt(self.bytes_per_slot)} = {_fmt(self.active_bytes)}",
            f"  checkpoints:  {self.num_checkpoints} x {_fmt(self.bytes_per_slot)} = {_fmt(self.checkpoint_bytes)}",
            f"  KV pages:     {self.num_pages} x {self.page_size} tokens x {_fmt(self.bytes_per_token)}/token"
            f" = {_fmt(self.kv_bytes)} ({self.num_pages * self.page_size} tokens)",
            f"  one checkpoint holds as many bytes as "
            f"{self.bytes_per_slot / max(self.bytes_per_token, 1):.0f} KV tokens",
        ])


def plan_memory(
    kv_layers: Sequence[KVLayerSpec],
    state_layers: Sequence[StateLayerSpec],
    *,
    budget_bytes: int,
    page_size: int,
    max_running: int,
    checkpoint_share: float = 0.2,
    kv_dtype: torch.dtype = torch.bfloat16,
) -> MemoryPlan:
    """Split budget_bytes into max_running active slots, checkpoint slots and KV pages."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    if not 0.0 <= checkpoint_share <= 1.0:
        raise ValueError(f"checkpoint_share must be in [0, 1], got {checkpoint_share}")
    per_token = kv_bytes_per_token(kv_layers, kv_dtype)
    per_slot = state_bytes_per_slot(state_layers)
    if per_token == 0:
        raise ValueError("kv_layers: no attention KV to size pages from")
    if per_slot == 0:
        raise ValueError("state_layers: no linear-layer state to size slots from")
    rest = budget_bytes - max_running * per_slot
    if rest < 0:
        raise ValueError(
            f"budget_bytes={budget_bytes} does not hold the {max_running} active slots "
            f"of {per_slot} bytes (max_running)"
        )
    num_ckpts = int(rest * checkpoint_share) // per_slot
    num_pages = (rest - num_ckpts * per_slot) // (per_token * page_size)
    return MemoryPlan(budget_bytes, page_size, num_pages, max_running, num_ckpts, per_token, per_slot)


def make_pools(
    plan: MemoryPlan,
    kv_layers: Sequence[KVLayerSpec],
    state_layers: Sequence[StateLayerSpec],
    kv_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> tuple[KVPool, StatePool]:
    """The pools a plan describes (device=None: pools that only count)."""
    kv = KVPool(plan.num_pages, plan.page_size, kv_layers, kv_dtype, device)
    state = StatePool(plan.num_active, plan.num_checkpoints, state_layers, device)
    return kv, state


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
