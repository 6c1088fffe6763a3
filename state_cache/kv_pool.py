"""Paged attention KV: `num_pages` pages of `page_size` tokens for every attention layer."""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Mapping, Sequence

import torch

from state_cache.base import IntegrityError

KVLayerSpec = Mapping[str, tuple[int, ...]]


def kv_bytes_per_token(layers: Sequence[KVLayerSpec], dtype: torch.dtype) -> int:
    """Bytes of KV one token takes over all attention layers (e.g. MLA {"kv": (1, 576)})."""
    return sum(math.prod(shape) * dtype.itemsize for layer in layers for shape in layer.values())


class KVPool:
    """Fixed pages with a free list and reference counts.

    `buffers[i][name]` is `[num_pages, page_size, *shape]` for attention layer i (ordinal
    among attention layers). With `device=None` no tensor is allocated (`buffers == []`):
    the pool only counts, and `layers`/`dtype` serve for byte accounting.
    Page ids are ints 0..num_pages-1. A page is free iff its count is 0.
    """

    journal = None  # a state_cache.journal.Journal recording copies, when the pool is mirrored

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layers: Sequence[KVLayerSpec] = (),
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        pin_memory: bool = False,
    ):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.layers = [dict(layer) for layer in layers]
        self.dtype = dtype
        self.bytes_per_token = kv_bytes_per_token(self.layers, dtype)
        self.bytes_per_page = self.bytes_per_token * page_size
        self.buffers: list[dict[str, torch.Tensor]] = []
        if device is not None:
            self.buffers = [
                {
                    name: torch.zeros((num_pages, page_size, *shape), dtype=dtype, device=device, pin_memory=pin_memory)
                    for name, shape in layer.items()
                }
                for layer in self.layers
            ]
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops 0, 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def alloc(self, num_pages: int) -> list[int] | None:
        """num_pages fresh pages with count 1, or None (and nothing taken) if too few are free."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num_pages)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def ref(self, pages: Iterable[int]) -> None:
        """Add one reference to each (already allocated) page."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._refs[p] == 0:
                raise ValueError(f"pages: page {p} is free, cannot take a reference")
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; returns how many pages became free.

        Checked before anything changes: a bad id or a page freed more often than it is
        referenced raises ValueError and leaves the pool as it was.
        """
        drops = Counter(pages)
        for p, n in drops.items():
            self._check_id(p)
            if self._refs[p] < n:
                raise ValueError(f"pages: page {p} is already free")
        freed = 0
        for p, n in drops.items():
            self._refs[p] -= n
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

    def copy_pages(self, pages: Sequence[int], dst: "KVPool", dst_pages: Sequence[int]) -> None:
        """Page contents into pages of another pool of the same layout (e.g. the host tier)."""
        if self.journal is not None:
            self.journal.record(self, "copy_pages", list(pages), dst, list(dst_pages))
        if not self.buffers:
            return
        dev = dst.buffers[0][next(iter(dst.buffers[0]))].device
        si = torch.tensor(list(pages), device=self.buffers[0][next(iter(self.buffers[0]))].device)
        di = torch.tensor(list(dst_pages), device=dev)
        for s_layer, d_layer in zip(self.buffers, dst.buffers):
            for name, buf in s_layer.items():
                d_layer[name][di] = buf[si].to(dev, non_blocking=False)

    def check_integrity(self) -> None:
        """free + referenced == total; the free list holds exactly the pages with count 0."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("kv pool: free list holds a page twice")
        zero = {p for p, r in enumerate(self._refs) if r == 0}
        if free != zero:
            raise IntegrityError(f"kv pool: free list != pages with count 0 ({sorted(free ^ zero)[:8]})")
        if any(r < 0 for r in self._refs):
            raise IntegrityError("kv pool: negative reference count")
        for layer, buf in zip(self.layers, self.buffers):
            for name, shape in layer.items():
                want = (self.num_pages, self.page_size, *shape)
                if tuple(buf[name].shape) != want or buf[name].dtype != self.dtype:
                    raise IntegrityError(f"kv pool: buffer {name!r} is {tuple(buf[name].shape)}, want {want}")

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"pages: page id {page} outside 0..{self.num_pages - 1}")
