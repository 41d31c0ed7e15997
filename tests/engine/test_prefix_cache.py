"""RadixCache on its own: match / insert / split / lock / evict, and a property test against a brute-force model."""

import itertools
import random

import pytest

from tokenmill.engine.prefix_cache import RadixCache

BS = 2


def blocks_for(tokens, ids):
    return [next(ids) for _ in range(len(tokens) // BS)]


def test_match_is_block_aligned_and_splits_inside_a_node():
    tree = RadixCache(BS)
    node, kept = tree.insert(None, None, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert kept == [10, 11, 12] and tree.cached_blocks == 3
    m = tree.match([1, 2, 3, 4, 9, 9, 9])
    assert m.blocks == [10, 11] and m.num_evictable == 2
    assert m.node is not node and m.node.children  # split: the upper part ends at the match
    assert node.key == [5, 6] and node.parent is m.node  # the original node keeps the tail
    assert tree.match([1, 2, 3]).blocks == [10]  # a partial block never matches
    assert tree.match([7, 8]).node is None
    tree.check()


def test_insert_keeps_the_blocks_already_cached():
    tree = RadixCache(BS)
    tree.insert(None, None, [1, 2, 3, 4], [10, 11])
    node, kept = tree.insert(None, None, [1, 2, 3, 4, 5, 6], [20, 21, 22])
    assert kept == [10, 11, 22]
    assert tree.match([1, 2, 3, 4, 5, 6, 0]).blocks == [10, 11, 22]
    tree.check()


def test_insert_continues_from_a_node():
    tree = RadixCache(BS)
    first, _ = tree.insert(None, None, [1, 2], [10])
    second, kept = tree.insert(None, first, [3, 4], [11])
    assert kept == [11] and second.parent is first
    assert tree.match([1, 2, 3, 4, 0]).blocks == [10, 11]
    tree.check()


def test_namespaces_never_share():
    tree = RadixCache(BS)
    tree.insert(("a",), None, [1, 2, 3, 4], [10, 11])
    assert tree.match([1, 2, 3, 4, 0], ("b",)).blocks == []
    assert tree.match([1, 2, 3, 4, 0], None).blocks == []
    assert tree.match([1, 2, 3, 4, 0], ("a",)).blocks == [10, 11]
    _, kept = tree.insert(("b",), None, [1, 2, 3, 4], [20, 21])
    assert kept == [20, 21]
    tree.check()


def test_locked_paths_are_not_evicted_and_lru_goes_first():
    tree = RadixCache(BS)
    old, _ = tree.insert(None, None, [1, 1, 1, 1], [10, 11])
    held, _ = tree.insert(None, None, [2, 2, 2, 2], [20, 21])
    new, _ = tree.insert(None, None, [3, 3, 3, 3], [30, 31])
    tree.lock(held)
    assert tree.evictable_blocks == 4
    tree.lock(old)
    tree.unlock(old)  # touched after `new`: now `new` is the least recently used
    assert tree.evict(1) == [31]  # a leaf gives up its tail block first
    assert tree.evict(2) == [30, 11]
    assert tree.evict(10) == [10]  # only locked blocks are left
    assert tree.match([2, 2, 2, 2, 0]).blocks == [20, 21]
    tree.check()
    tree.unlock(held)
    assert sorted(tree.evict(10)) == [20, 21] and tree.cached_blocks == 0
    tree.check()


def test_eviction_climbs_to_parents_and_drops_empty_salted_roots():
    tree = RadixCache(BS)
    base, _ = tree.insert(("t",), None, [1, 2], [10])
    tree.insert(("t",), base, [3, 4], [11])
    tree.insert(("t",), base, [5, 6], [12])
    assert sorted(tree.evict(3)) == [10, 11, 12]
    assert ("t",) not in tree.roots
    tree.check()


def test_lock_survives_a_split_of_the_locked_node():
    tree = RadixCache(BS)
    node, _ = tree.insert(None, None, [1, 2, 3, 4], [10, 11])
    tree.lock(node)
    tree.match([1, 2, 9, 9])  # splits `node` above it
    assert node.parent.lock_ref == 1 and node.lock_ref == 1
    assert tree.evict(5) == []
    tree.unlock(node)
    tree.check()
    assert tree.evictable_blocks == 2


class BruteForce:
    """What should be cached: every cached block keyed by (namespace, all tokens through its end)."""

    def __init__(self):
        self.blocks: dict[tuple, int] = {}

    def match(self, ns, tokens):
        out = []
        for end in range(BS, len(tokens) + 1, BS):
            b = self.blocks.get((ns, tuple(tokens[:end])))
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, ns, tokens, blocks):
        kept = []
        for i, b in enumerate(blocks):
            kept.append(self.blocks.setdefault((ns, tuple(tokens[:(i + 1) * BS])), b))
        return kept


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_agree_with_a_brute_force_model(seed):
    rng = random.Random(seed)
    tree, model = RadixCache(BS), BruteForce()
    ids = itertools.count(100)
    locks: list[tuple] = []  # (node, namespace, tokens of its path)
    namespaces = [None, ("x",)]

    def random_tokens():
        return [rng.randint(0, 1) for _ in range(rng.randint(0, 5) * BS + rng.randint(0, 1))]

    for _ in range(300):
        op = rng.random()
        ns = rng.choice(namespaces)
        if op < 0.35:  # insert a whole sequence from the root, or continue a locked path
            if locks and rng.random() < 0.5:
                node, ns, prefix = rng.choice(locks)
                tail = [rng.randint(0, 1) for _ in range(rng.randint(1, 3) * BS)]
                _, kept = tree.insert(ns, node, tail, blocks_for(tail, ids))
                full = prefix + tail
                # the model: the prefix is cached (locked) already; the tail continues it
                expect = model.insert(ns, full, model.match(ns, prefix) + kept)
                assert expect[len(prefix) // BS:] == kept
            else:
                tokens = random_tokens()
                tokens = tokens[:len(tokens) // BS * BS]
                new = blocks_for(tokens, ids)
                _, kept = tree.insert(ns, None, tokens, new)
                assert kept == model.insert(ns, tokens, new)
        elif op < 0.6:  # match, then maybe lock what matched
            tokens = random_tokens()
            m = tree.match(tokens, ns)
            assert m.blocks == model.match(ns, tokens)
            if m.node is not None:
                assert m.node.path_blocks() == m.blocks
                if rng.random() < 0.5:
                    tree.lock(m.node)
                    locks.append((m.node, ns, tokens[:len(m.blocks) * BS]))
        elif op < 0.75 and locks:
            node, _, _ = locks.pop(rng.randrange(len(locks)))
            tree.unlock(node)
        else:  # evict
            want = rng.randint(1, 4)
            before = tree.evictable_blocks
            evicted = tree.evict(want)
            assert len(evicted) == min(want, before)
            locked = {b for node, _, _ in locks for b in node.path_blocks()}
            assert not locked & set(evicted), "a locked block was evicted"
            gone = {k for k, b in model.blocks.items() if b in set(evicted)}
            assert len(gone) == len(evicted)
            for k in gone:
                del model.blocks[k]
            # what is left is still prefix-closed: eviction only takes blocks nothing cached extends
            for ns_, toks in model.blocks:
                assert len(toks) == BS or (ns_, toks[:-BS]) in model.blocks
        tree.check()
        assert tree.cached_blocks == len(model.blocks)
        assert sorted(tree.block_ids()) == sorted(model.blocks.values())
        locked_blocks = {b for node, _, _ in locks for b in node.path_blocks()}
        assert tree.evictable_blocks == tree.cached_blocks - len(locked_blocks)
    for node, _, _ in locks:
        tree.unlock(node)
    tree.evict(10**9)
    assert tree.cached_blocks == 0 and tree.evictable_blocks == 0
    tree.check()
