"""Recurrent-state slots: an active region (one per running request) and a checkpoint region.

Slot ids 0..num_active-1 are active slots, num_active..num_active+num_checkpoints-1 are
checkpoint slots; both live in the same per-layer tensors so a kernel indexes either with
one slot id, and a forward can write an intermediate state straight into a checkpoint slot.

    slot state      how it gets there                    who may write it
    free            start, free()                        nobody
    active          alloc_active() (zeroed)              the request's kernels, restore()
    writable ckpt   alloc_checkpoint()                   save(), the forward
    sealed ckpt     seal() (the cache adopted it)        nobody, until free()
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from state_cache.base import IntegrityError

StateLayerSpec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def state_bytes_per_slot(layers: Sequence[StateLayerSpec]) -> int:
    """Bytes of one slot over all linear layers (recurrent state + conv tails, own dtypes)."""
    return sum(
        math.prod(shape) * dtype.itemsize
        for layer in layers
        for shape, dtype in layer.values()
    )


class StatePool:
    """Fixed state slots; `buffers[i][name]` is `[num_active + num_checkpoints, *shape]`.

    Index i is the linear-layer ordinal. Each tensor keeps its declared dtype, so a
    checkpoint of an fp32 recurrent state stays fp32. With `device=None` nothing is
    allocated (`buffers == []`) and copies only check their arguments.
    """

    def __init__(
        self,
        num_active: int,
        num_checkpoints: int,
        layers: Sequence[StateLayerSpec] = (),
        device: torch.device | str | None = None,
    ):
        if num_active < 0:
            raise ValueError(f"num_active must be >= 0, got {num_active}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        self.num_active = num_active
        self.num_checkpoints = num_checkpoints
        self.num_slots = num_active + num_checkpoints
        self.layers = [dict(layer) for layer in layers]
        self.bytes_per_slot = state_bytes_per_slot(self.layers)
        self.buffers: list[dict[str, torch.Tensor]] = []
        if device is not None:
            self.buffers = [
                {name: torch.zeros((self.num_slots, *shape), dtype=dtype, device=device)
                 for name, (shape, dtype) in layer.items()}
                for layer in self.layers
            ]
        self._free_active = list(range(num_active - 1, -1, -1))
        self._free_ckpt = list(range(self.num_slots - 1, num_active - 1, -1))
        self._used: set[int] = set()
        self._sealed: set[int] = set()

    @property
    def num_free_active(self) -> int:
        return len(self._free_active)

    @property
    def num_free_checkpoints(self) -> int:
        return len(self._free_ckpt)

    def is_checkpoint(self, slot: int) -> bool:
        return self.num_active <= slot < self.num_slots

    def is_allocated(self, slot: int) -> bool:
        return slot in self._used

    def is_sealed(self, slot: int) -> bool:
        return slot in self._sealed

    @property
    def num_sealed(self) -> int:
        return len(self._sealed)

    def alloc_active(self) -> int | None:
        """A zeroed active slot (initial state of a fresh request), or None if none is free."""
        if not self._free_active:
            return None
        slot = self._free_active.pop()
        self._used.add(slot)
        for layer in self.buffers:
            for buf in layer.values():
                buf[slot].zero_()
        return slot

    def alloc_checkpoint(self) -> int | None:
        """A writable checkpoint slot, or None if none is free."""
        if not self._free_ckpt:
            return None
        slot = self._free_ckpt.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return an allocated slot (active or checkpoint) to its region."""
        self._check_used(slot, "slot")
        self._used.remove(slot)
        self._sealed.discard(slot)
        (self._free_ckpt if self.is_checkpoint(slot) else self._free_active).append(slot)

    def seal(self, slot: int) -> None:
        """Make a checkpoint slot immutable (the cache adopted it) until it is freed."""
        self._check_checkpoint(slot, "slot")
        self._sealed.add(slot)

    def save(self, active_slot: int, checkpoint_slot: int) -> None:
        """Copy on checkpoint: every layer's state of an active slot into a writable checkpoint slot."""
        self._check_active(active_slot, "active_slot")
        self._check_checkpoint(checkpoint_slot, "checkpoint_slot")
        if checkpoint_slot in self._sealed:
            raise ValueError(f"checkpoint_slot {checkpoint_slot} is sealed (held by the cache)")
        self._copy(active_slot, checkpoint_slot)

    def restore(self, checkpoint_slot: int, active_slot: int) -> None:
        """Copy on hit: every layer's state of a checkpoint slot into an active slot, bit-exact."""
        self._check_checkpoint(checkpoint_slot, "checkpoint_slot")
        self._check_active(active_slot, "active_slot")
        self._copy(checkpoint_slot, active_slot)

    def check_integrity(self) -> None:
        """Each region: free + used == its size, no slot twice; sealed slots are used checkpoints."""
        active = set(range(self.num_active))
        ckpt = set(range(self.num_active, self.num_slots))
        for name, free, region in (("active", self._free_active, active), ("checkpoint", self._free_ckpt, ckpt)):
            if len(set(free)) != len(free):
                raise IntegrityError(f"state pool: {name} free list holds a slot twice")
            if not set(free) <= region:
                raise IntegrityError(f"state pool: {name} free list holds a slot of the other region")
            if set(free) & self._used:
                raise IntegrityError(f"state pool: {name} slot both free and used")
        if len(self._free_active) + len(self._free_ckpt) + len(self._used) != self.num_slots:
            raise IntegrityError("state pool: free + used != total")
        if not self._sealed <= (self._used & ckpt):
            raise IntegrityError("state pool: a sealed slot is free or not a checkpoint slot")
        for layer, buf in zip(self.layers, self.buffers):
            for name, (shape, dtype) in layer.items():
                if tuple(buf[name].shape) != (self.num_slots, *shape) or buf[name].dtype != dtype:
                    raise IntegrityError(f"state pool: buffer {name!r} is {tuple(buf[name].shape)} {buf[name].dtype}")

    def _copy(self, src: int, dst: int) -> None:
        for layer in self.buffers:
            for buf in layer.values():
                buf[dst].copy_(buf[src])

    def _check_used(self, slot: int, arg: str) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{arg}: slot id {slot} outside 0..{self.num_slots - 1}")
        if slot not in self._used:
            raise ValueError(f"{arg}: slot {slot} is not allocated")

    def _check_active(self, slot: int, arg: str) -> None:
        self._check_used(slot, arg)
        if self.is_checkpoint(slot):
            raise ValueError(f"{arg}: slot {slot} is a checkpoint slot, want an active one")

    def _check_checkpoint(self, slot: int, arg: str) -> None:
        self._check_used(slot, arg)
        if not self.is_checkpoint(slot):
            raise ValueError(f"{arg}: slot {slot} is an active slot, want a checkpoint one")
