"""A record of the pools' tensor operations, for copies of the pools in other processes.

Under tensor parallelism rank 0 keeps all the bookkeeping (free lists, reference counts, the
radix tree) and every other rank holds only the tensors of its shard of the same pools. The
operations that move data in or between pools outside a forward (a checkpoint saved,
restored or sealed into pages; pages moved to or from the host tier) are recorded on rank 0,
sent with the next forward, and replayed in order on the other ranks' pools, so each rank's
tensors hold its shard of the same contents.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class PoolRef(NamedTuple):
    """A pool named in a recorded operation's arguments (pools themselves stay in their process)."""

    role: str


class Journal:
    """Records the tensor operations of `pools` (role -> pool, None skipped), which it attaches to."""

    def __init__(self, pools: dict[str, Any]):
        self.pools = {role: p for role, p in pools.items() if p is not None}
        self._roles = {id(p): role for role, p in self.pools.items()}
        self.ops: list[tuple[str, str, tuple]] = []
        for p in self.pools.values():
            p.journal = self

    def record(self, pool: Any, method: str, *args: Any) -> None:
        args = tuple(PoolRef(self._roles[id(a)]) if id(a) in self._roles else a for a in args)
        self.ops.append((self._roles[id(pool)], method, args))

    def drain(self) -> list[tuple[str, str, tuple]]:
        """The operations recorded since the last drain, oldest first."""
        ops, self.ops = self.ops, []
        return ops


def replay(ops: list[tuple[str, str, tuple]], pools: dict[str, Any]) -> None:
    """Apply recorded operations to another process's pools (same roles, same layout)."""
    for role, method, args in ops:
        getattr(pools[role], method)(*(pools[a.role] if isinstance(a, PoolRef) else a for a in args))
