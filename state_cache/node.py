"""The radix tree's node and the structural operations on it (no pools, no policy).

Every edge is a whole number of pages: node.key holds tokens [node.start, node.end) and
node.pages their KV pages, one per page_size tokens. A node may own a checkpoint slot with
the state after node.end tokens. Children are keyed by the first page of their key.
"""
from __future__ import annotations

from typing import Iterator, Sequence


class Node:
    __slots__ = ("key", "pages", "parent", "children", "start", "checkpoint", "lock_ref", "pins", "last_access",
                 "resumed_at", "kind", "host", "host_ckpt")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None, start: int, now: float):
        self.key = key
        self.pages = pages
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[tuple[int, ...], Node] = {}
        self.start = start
        self.checkpoint: int | None = None  # slot id
        self.lock_ref = 0  # locks on this node or below it: its pages stay
        self.pins = 0  # locks on this very node: its checkpoint stays too
        self.last_access = now  # a lookup or insert passed through (its KV was used)
        self.resumed_at = now  # a request resumed from its checkpoint (or the checkpoint was written)
        self.kind: str | None = None  # the admission rule that wrote its checkpoint
        self.host = False  # pages are host-tier pages (never locked; every node below is on the host too)
        self.host_ckpt: list[int] | None = None  # a checkpoint moved to the host tier: its host pages

    @property
    def has_checkpoint(self) -> bool:
        """A checkpoint in either tier."""
        return self.checkpoint is not None or self.host_ckpt is not None

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        where = " host" if self.host else ""
        return f"Node[{self.start}, {self.end}){where} ckpt={self.checkpoint} locks={self.lock_ref}"


def ids(tokens: Sequence[int]) -> tuple[int, ...]:
    """Token ids as a tuple (from a list, a tuple or a tensor)."""
    return tuple(tokens.tolist() if hasattr(tokens, "tolist") else tokens)


def common_pages(key: tuple[int, ...], tokens: tuple[int, ...], pos: int, ps: int) -> int:
    """How many tokens of key match tokens[pos:], rounded down to whole pages."""
    if tokens[pos:pos + len(key)] == key:
        return len(key)
    n = 0
    while n + ps <= len(key) and key[n:n + ps] == tokens[pos + n:pos + n + ps]:
        n += ps
    return n


def walk(root: Node, tokens: tuple[int, ...], ps: int) -> tuple[list[Node], int]:
    """Nodes along the cached path of tokens below `root` (a node on that path, whose key the
    caller has checked), the last possibly matching only partly, and the matched length."""
    node, pos, path = root, root.end, []
    while len(tokens) - pos >= ps:
        child = node.children.get(tokens[pos:pos + ps])
        if child is None:
            break
        n = common_pages(child.key, tokens, pos, ps)
        path.append(child)
        pos += n
        if n < len(child.key):
            break
        node = child
    return path, pos


def split(child: Node, n: int, ps: int) -> Node:
    """Cut child's edge after n tokens (whole pages); the new upper node inherits the locks.

    The checkpoint stays on child, which still ends where it did.
    """
    parent = child.parent
    if parent is None:
        raise ValueError("child: the root or an evicted node has no edge to split")
    upper = Node(child.key[:n], child.pages[: n // ps], parent, child.start, child.last_access)
    upper.lock_ref, upper.host = child.lock_ref, child.host
    parent.children[child.key[:ps]] = upper
    child.key, child.pages = child.key[n:], child.pages[n // ps:]
    child.start, child.parent = child.start + n, upper
    upper.children[child.key[:ps]] = child
    return upper


def node_at(root: Node, tokens: tuple[int, ...], pos: int, ps: int) -> Node:
    """The node on the cached path of tokens whose edge holds position pos (its end >= pos)."""
    node = root
    while node.end < pos:
        node = node.children[tokens[node.end:node.end + ps]]
    return node


def ancestors(node: Node) -> Iterator[Node]:
    """node, its parent, ... up to (not including) the root."""
    while node.parent is not None:
        yield node
        node = node.parent


def path_pages(node: Node) -> list[int]:
    """KV pages from the root down to node, in token order."""
    chain = []
    while node.parent is not None:
        chain.append(node.pages)
        node = node.parent
    return [p for pages in reversed(chain) for p in pages]


def iter_nodes(root: Node) -> Iterator[Node]:
    """Every node below root (not root itself)."""
    stack = list(root.children.values())
    while stack:
        x = stack.pop()
        stack.extend(x.children.values())
        yield x
