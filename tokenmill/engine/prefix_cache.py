"""RadixCache: a radix tree over full KV blocks, keyed by their tokens, so requests that share a prefix share blocks.

Plain Python: a block is only an id; the tree knows nothing about the pool's free list or about requests.
Each node holds a run of whole blocks (its `key` is their tokens, `len(key) == len(blocks) * block_size`); the
path from a namespace's root spells a prefix, so equal tokens at a different position or after a different
prefix never match. Children are keyed by the tokens of their first block, so siblings always differ in their
first block and a match can only end on a block boundary.

Locks: a request that uses a path holds a lock on its deepest node; `lock` counts it on every node below the
root, so an unlocked node has only unlocked descendants and an unlocked leaf can be evicted. `evictable_blocks`
counts the blocks of unlocked nodes, which is what eviction can give back.

Namespaces keep tenants apart (a request's cache salt, and room for other extra keys such as an adapter id):
each has its own root, and requests in different namespaces never share a block.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.request import Request


@dataclass(eq=False)
class RadixNode:
    key: list[int]
    blocks: list[int]
    parent: RadixNode | None
    namespace: Hashable = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def path_blocks(self) -> list[int]:
        """Every block from the root down to this node, in order."""
        runs = []
        node: RadixNode | None = self
        while node is not None:
            runs.append(node.blocks)
            node = node.parent
        return [b for run in reversed(runs) for b in run]


@dataclass
class PrefixMatch:
    """The longest cached prefix of some tokens: `node` ends exactly at it (None: nothing cached matched);
    `num_evictable` of its blocks sit in unlocked nodes (they stop counting as reclaimable once it is locked)."""

    node: RadixNode | None
    blocks: list[int]
    num_evictable: int


class RadixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.roots: dict[Hashable, RadixNode] = {}
        self.cached_blocks = 0
        self.evictable_blocks = 0
        self._clock = itertools.count(1)  # a logical clock for LRU: deterministic, unlike wall time

    def root(self, namespace: Hashable = None) -> RadixNode:
        node = self.roots.get(namespace)
        if node is None:
            node = self.roots[namespace] = RadixNode([], [], None, namespace)
        return node

    # ---- lookup ------------------------------------------------------------------------------------------------
    def _common_blocks(self, key: list[int], tokens: Sequence[int], pos: int) -> int:
        """How many whole blocks of `key` equal `tokens[pos:]`, block by block."""
        if key == tokens[pos:pos + len(key)]:  # the usual case: one C-level compare
            return len(key) // self.block_size
        bs, n = self.block_size, 0
        while (n + 1) * bs <= len(key) and key[n * bs:(n + 1) * bs] == tokens[pos + n * bs:pos + (n + 1) * bs]:
            n += 1
        return n

    def match(self, tokens: Sequence[int], namespace: Hashable = None) -> PrefixMatch:
        """The longest cached block-aligned prefix of `tokens`. A match that ends inside a node splits it, so the
        match always ends at a node that can be locked."""
        node, pos, bs = self.roots.get(namespace), 0, self.block_size
        blocks: list[int] = []
        evictable = 0
        while node is not None and pos + bs <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            n = self._common_blocks(child.key, tokens, pos)
            if n * bs < len(child.key):
                child = self._split(child, n)
            blocks.extend(child.blocks)
            if child.lock_ref == 0:
                evictable += len(child.blocks)
            pos += n * bs
            node = child
            if n * bs < len(child.key):
                break
        return PrefixMatch(node if blocks else None, blocks, evictable)

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after `num_blocks` blocks: a new upper node takes the head; `node` keeps the tail (so whoever
        holds `node` still holds the deepest node of its path). Returns the upper node."""
        cut = num_blocks * self.block_size
        upper = RadixNode(node.key[:cut], node.blocks[:num_blocks], node.parent, node.namespace,
                          lock_ref=node.lock_ref, last_access=node.last_access)
        node.parent.children[tuple(node.key[:self.block_size])] = upper
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[num_blocks:], upper
        upper.children[tuple(node.key[:self.block_size])] = node
        return upper

    # ---- insert ------------------------------------------------------------------------------------------------
    def insert(self, namespace: Hashable, node: RadixNode | None, tokens: Sequence[int],
               blocks: Sequence[int]) -> tuple[RadixNode | None, list[int]]:
        """Cache `blocks` (holding `tokens`, whole blocks) as the continuation of `node`'s path (None: from the
        namespace's root). Where the tree already holds those tokens, its blocks are kept. Returns the node ending
        the new path and the tree's blocks for `tokens` (equal to `blocks` except where the tree had them)."""
        bs = self.block_size
        assert len(tokens) == len(blocks) * bs, "insert takes whole blocks"
        if not tokens:
            return node, []
        node = node or self.root(namespace)
        pos, out = 0, []
        while pos < len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                child = RadixNode(list(tokens[pos:]), list(blocks[pos // bs:]), node, node.namespace,
                                  last_access=next(self._clock))
                node.children[tuple(tokens[pos:pos + bs])] = child
                self.cached_blocks += len(child.blocks)
                self.evictable_blocks += len(child.blocks)  # new nodes start unlocked
                out.extend(child.blocks)
                return child, out
            n = self._common_blocks(child.key, tokens, pos)
            if n * bs < len(child.key):
                child = self._split(child, n)
            out.extend(child.blocks)
            pos += n * bs
            node = child
        return node, out

    # ---- locks ---------------------------------------------------------------------------------------------
    def lock(self, node: RadixNode | None) -> None:
        """Count one more user of `node`'s path (roots are never locked: they hold no blocks)."""
        now = next(self._clock)
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node.last_access = now
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        now = next(self._clock)
        while node is not None and not node.is_root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
            node.last_access = now
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to `num_blocks` blocks from unlocked leaves, least recently used first (a leaf gives up its
        tail blocks first, so a partly evicted prefix still matches). Returns the block ids removed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and not n.is_root
                and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            take = min(num_blocks - len(freed), len(leaf.blocks))
            freed.extend(leaf.blocks[len(leaf.blocks) - take:])
            self.cached_blocks -= take
            self.evictable_blocks -= take
            if take < len(leaf.blocks):
                del leaf.blocks[len(leaf.blocks) - take:]
                del leaf.key[len(leaf.blocks) * self.block_size:]
                break
            parent = leaf.parent
            del parent.children[tuple(leaf.key[:self.block_size])]
            if parent.is_root:
                if not parent.children and parent.namespace is not None:
                    del self.roots[parent.namespace]  # salted roots come and go with their tenants
            elif not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ---- inspection ------------------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def block_ids(self) -> list[int]:
        return [b for n in self._nodes() for b in n.blocks]

    def check(self) -> None:
        """Structural invariants (tests call this after every operation)."""
        bs, blocks, evictable = self.block_size, [], 0
        for node in self._nodes():
            assert len(node.key) == len(node.blocks) * bs
            if node.is_root:
                assert node.lock_ref == 0 and (node.children or node.namespace is None), "stale root"
            else:
                assert node.blocks, "empty non-root node"
                assert node.parent.children.get(tuple(node.key[:bs])) is node
                assert node.parent.is_root or node.parent.lock_ref >= node.lock_ref
                assert node.namespace == node.parent.namespace
            assert node.is_root or node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            blocks.extend(node.blocks)
            if node.lock_ref == 0:
                evictable += len(node.blocks)
        assert len(blocks) == len(set(blocks)) == self.cached_blocks, "a block cached twice or miscounted"
        assert evictable == self.evictable_blocks, (evictable, self.evictable_blocks)


def computed_by_others(request: Request, cached_tokens: int, prefilling: list[Request], block_size: int) -> bool:
    """True when a running prefill is about to compute the block that follows `request`'s cached prefix, with the
    same tokens before it: waiting for it beats computing the same KV twice (the n samples of one request, a burst
    of requests with one system prompt)."""
    bs = block_size
    end = cached_tokens + bs  # the next block, if this request could take it from the cache
    if end >= request.num_tokens:
        return False
    block = request.tokens_slice(end - bs, end)
    for other in prefilling:
        if (other.num_computed_tokens < end <= other.num_tokens and other.cache_namespace == request.cache_namespace
                and other.tokens_slice(end - bs, end) == block
                and other.tokens_slice(0, end - bs) == request.tokens_slice(0, end - bs)):
            return True
    return False
