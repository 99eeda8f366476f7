"""Union-find over hashable keys: iterative find with path compression, union by size.

`union(parent, child)` also records which key leads the merged group the way pt2e defines it (the
parent's leader), so the sharing semantics do not depend on how the trees are balanced.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["K", "UnionFind"]

K = TypeVar("K", bound=Hashable)


class UnionFind(Generic[K]):
    """Disjoint sets with a pt2e-style leader per set."""

    def __init__(self, keys: Iterable[K] = ()) -> None:
        self._parent: dict[K, K] = {}
        self._size: dict[K, int] = {}
        self._leader: dict[K, K] = {}
        for key in keys:
            self.add(key)

    def add(self, key: K) -> None:
        """Add `key` as a set of its own (no-op if present)."""
        if key not in self._parent:
            self._parent[key] = key
            self._size[key] = 1
            self._leader[key] = key

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def find(self, key: K) -> K:
        """The tree root of `key`'s set, compressing the path on the way."""
        root = key
        parent = self._parent
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:
            parent[key], key = root, parent[key]
        return root

    def leader(self, key: K) -> K:
        """The key that leads `key`'s set: the parent side of the unions that built it."""
        return self._leader[self.find(key)]

    def union(self, parent: K, child: K, child_leads: bool = False) -> None:
        """Merge `child`'s set into `parent`'s set; the merged set keeps the parent's leader
        (the child's, when child_leads is True)."""
        self.link(self.find(parent), self.find(child), child_leads)

    def leader_of_root(self, root: K) -> K:
        """The leader of the set whose tree root is `root` (no find)."""
        return self._leader[root]

    def link(self, root_parent: K, root_child: K, child_leads: bool = False) -> None:
        """union() for two keys already known to be tree roots."""
        if root_parent == root_child:
            return
        leader = self._leader[root_child if child_leads else root_parent]
        if self._size[root_parent] < self._size[root_child]:
            root_parent, root_child = root_child, root_parent
        self._parent[root_child] = root_parent
        self._size[root_parent] += self._size[root_child]
        self._leader[root_parent] = leader

    def group_ids(self, keys: Iterable[K]) -> dict[K, int]:
        """Number the sets 0, 1, ... in the order their first key appears in `keys`."""
        ids: dict[K, int] = {}
        by_root: dict[K, int] = {}
        for key in keys:
            root = self.find(key)
            if root not in by_root:
                by_root[root] = len(by_root)
            ids[key] = by_root[root]
        return ids
