"""KVCacheManager: which blocks each request holds, and the prefix cache that lets requests share them (the ids
and their ref counts: engine/block_pool.py).

Plain Python: the tensors that hold K/V live in the model runner; here a block is only an id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.kv_layout import KVLayout
from tokenmill.engine.prefix_cache import PrefixMatch, RadixCache
from tokenmill.engine.state_slots import StateSlots
from tokenmill.engine.state_snapshots import StateSnapshots
from tokenmill.engine.window_pages import WindowPages
from tokenmill.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative since start-up (counters) except `cached_blocks` (a gauge)."""

    queries: int = 0  # tokens looked up when requests were admitted
    hits: int = 0  # of those, tokens found cached
    evicted_blocks: int = 0
    cached_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class Chunk(Protocol):
    """A request's share of a step (engine/step_types.py ScheduledRequest)."""

    request: Request
    num_new_tokens: int


class KVCacheManager:
    """Gives each request the blocks its tokens need, one block at a time, and takes them back through `free`,
    the only way blocks return (finish, abort, preemption, error).

    With prefix caching, a request first takes the longest cached prefix of its tokens (`match` + `admit`: the
    blocks are shared, ref count +1, and its computed tokens start there); its own blocks join the radix tree as
    they fill (`cache_blocks`, after each step) and when it ends, so later requests can share them. Cached blocks
    no one holds stay until the pool runs short, then leave in LRU order.

    KV loaded from a transfer (disaggregated prefill) was computed elsewhere, by whoever made the producer request:
    it joins the tree only under the request's cache salt, shared with that tenant alone. A request that loads KV
    without a salt keeps all its blocks private (`_private`): it still takes cached blocks, but none of its own join
    the tree, so pushed KV never answers another request's prefix lookup.

    With a hybrid layout (engine/kv_layout.py) the pool's unit is a page: a block takes one for its full-attention
    layers and `num_window_tables` more for its window layers while it is inside the window (`window`,
    engine/window_pages.py). Counts of free blocks are then counts of pages.

    A layout with state layers (a hybrid model's recurrent or convolution layers) gives each admitted request a
    state slot beside its blocks (`state`, engine/state_slots.py), `num_state_slots` of them, returned by `free`
    with its blocks. With prefix caching such a model keeps `num_snapshots` copies of states taken at block
    boundaries (`snapshots`, engine/state_snapshots.py): a hit ends at the deepest matched block that has one, and
    the request's slot starts from it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 layout: KVLayout | None = None, num_state_slots: int = 0, num_snapshots: int = 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.layout = layout if layout is not None else KVLayout.uniform(1, block_size)
        self.state = StateSlots(num_state_slots) if self.layout.state_layers else None
        assert self.state is None or num_state_slots > 0, "a layout with state layers needs state slots"
        self.snapshots = (StateSnapshots(num_state_slots, num_snapshots)
                          if self.state is not None and enable_prefix_caching and num_snapshots else None)
        self.tree = (RadixCache(block_size) if enable_prefix_caching and (self.state is None or self.snapshots)
                     else None)
        self.window = WindowPages(self.pool, self.layout) if self.layout.hybrid else None
        self.pages_per_block = self.layout.pages_per_block
        self.prefix_stats = PrefixCacheStats()
        self._private: set[str] = set()  # requests holding loaded KV without a cache salt: none of theirs is cached

    @property
    def prefix_caching(self) -> bool:
        return self.tree is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks (pages) a new allocation can get: free ones plus cached ones no request holds (evictable)."""
        return (self.pool.num_free_blocks + (self.tree.evictable_blocks if self.tree else 0)
                + (self.window.num_idle_pages if self.window else 0))

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (idle cached blocks count as free: they are reclaimable)."""
        return 1.0 - self.num_free_blocks / self.pool.num_blocks

    def prefix_cache_stats(self) -> PrefixCacheStats:
        s = self.prefix_stats
        return PrefixCacheStats(s.queries, s.hits, s.evicted_blocks, self.tree.cached_blocks if self.tree else 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pages_needed(self, num_tokens: int) -> int:
        """Pages a request with no blocks yet takes for its first `num_tokens` tokens (all written in one step)."""
        return self.blocks_needed(num_tokens) * self.pages_per_block

    def pages_to_grow(self, request: Request, num_new_tokens: int) -> int:
        """Pages `request` takes to compute `num_new_tokens` more tokens."""
        new_blocks = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        return max(0, new_blocks) * self.pages_per_block

    def growth_cost(self, num_computed: int, num_tokens: int) -> int:
        """Token slots of the pool that a request at `num_computed` tokens uses up to grow `num_tokens` more, for
        headroom estimates: a token each, plus, for a hybrid layout, its window pages' share while the window
        still grows (a long request's window pages are recycled, not added)."""
        if self.window is None:
            return num_tokens
        cap = self.layout.window + self.block_size
        return num_tokens + self.window.per_block * max(0, min(num_computed + num_tokens, cap) - min(num_computed, cap))

    # ---- prefix hits ---------------------------------------------------------------------------------------
    def _matchable(self, request: Request) -> list[int]:
        """The tokens a cache hit may cover: whole blocks, always leaving the last token to compute (its logits
        are needed), so a hit never ends in a block this request will write."""
        n = (request.num_tokens - 1) // self.block_size * self.block_size
        return request.tokens_slice(0, n)

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of `request` the cache holds now (for ranking the waiting queue; a match may split a node,
        which changes nothing cached)."""
        match = self.match(request)
        return len(match.blocks) * self.block_size if match else 0

    def match(self, request: Request) -> PrefixMatch | None:
        """The cached prefix `request` may take; none for a request that wants prompt logprobs (cached positions
        would have no logits), though its own blocks still join the cache."""
        if self.tree is None or request.num_computed_tokens or request.computes_whole_prompt:
            return None
        tokens = self._matchable(request)
        match = self.tree.match(tokens, request.cache_namespace)
        if self.window is not None and match.blocks:  # a hit needs its last window's window pages too
            n = self.window.hit_blocks(match.blocks)
            if n < len(match.blocks):
                match = self.tree.match(tokens[:n * self.block_size], request.cache_namespace)
        if self.snapshots is not None and match.blocks:  # a hit needs the state at its end too
            n = next((i + 1 for i in range(len(match.blocks) - 1, -1, -1)
                      if self.snapshots.row_of(match.blocks[i]) is not None), 0)
            if n < len(match.blocks):
                match = self.tree.match(tokens[:n * self.block_size], request.cache_namespace)
        return match

    def admit(self, request: Request, match: PrefixMatch | None, num_new_tokens: int, lookahead: int = 0) -> bool:
        """Give a waiting request its cached prefix and room for `num_new_tokens` (+ `lookahead` slots a draft
        model writes ahead); False (nothing changed) if the pool cannot hold them."""
        hit = match.blocks if match else []
        num_new_tokens += lookahead
        loaded = self.num_loaded(request, match)
        need = self.blocks_needed(len(hit) * self.block_size + loaded + num_new_tokens) - len(hit)
        need *= self.pages_per_block
        taken = (match.num_evictable + (self.window.idle_in_hit(hit) if self.window else 0)) if match else 0
        if need > self.num_free_blocks - taken:
            return False
        if self.state is not None and not self.state.take(request):
            return False
        if self.tree is not None:
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += len(hit) * self.block_size
        if hit:
            self.tree.lock(match.node)
            self.pool.share(hit)
            request.block_ids = list(hit)
            if self.window is not None:
                self.window.take_hit(request, hit)
            request.cache_node, request.num_cached_blocks = match.node, len(hit)
            request.num_computed_tokens = len(hit) * self.block_size
            if self.snapshots is not None:
                request.state_load = self.snapshots.read(hit[-1])
        if request.num_cached_tokens is None:
            request.num_cached_tokens = len(hit) * self.block_size
        if loaded:  # KV from a producer fills the tokens past the hit: computed once the engine core writes it
            start = len(hit) * self.block_size
            request.pending_load = (start, start + loaded)
            request.num_computed_tokens = start + loaded
            if request.cache_salt is None:
                self._private.add(request.request_id)
        request.num_external_tokens = 0
        ok = self.allocate_slots(request, num_new_tokens)
        assert ok, "admit checked the room"
        return True

    def num_loaded(self, request: Request, match: PrefixMatch | None) -> int:
        """Tokens of a request admitted with `match` that its external KV (disaggregated prefill) fills: those
        past the cached prefix."""
        if not request.num_external_tokens:
            return 0
        return max(0, request.num_external_tokens - (len(match.blocks) * self.block_size if match else 0))

    # ---- allocation ------------------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and nothing changed) if the pool is short.
        Evicts idle cached blocks when the free list alone is short."""
        need = self.pages_to_grow(request, num_new_tokens)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        self._reclaim(need - self.pool.num_free_blocks)
        pages = self.pool.allocate(need)
        new_blocks = need // self.pages_per_block
        request.block_ids.extend(pages[:new_blocks])
        if self.window is not None:
            self.window.extend(request, pages[new_blocks:])
        return True

    def _reclaim(self, short: int) -> None:
        """Free `short` more pages from the cache: idle window pages first (a block's window pages matter to a
        hit ending within the window only), then blocks from the radix tree's unlocked leaves."""
        if short <= 0:
            return
        if self.window is not None:
            freed = self.window.reclaim(short)
            self.prefix_stats.evicted_blocks += freed
            short -= freed
        if short > 0:
            evicted = self.tree.evict(short)
            self.pool.uncache(evicted)
            if self.snapshots is not None:
                self.snapshots.forget(evicted)
            self.prefix_stats.evicted_blocks += len(evicted)
            if self.window is not None:
                self.prefix_stats.evicted_blocks += self.window.forget(evicted)

    def slide_window(self, request: Request) -> None:
        """After a step: the window pages of blocks no later token reads go back (hybrid layout only)."""
        if self.window is not None:
            self.window.slide(request)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (rejected draft tokens' slots): they hold no
        computed token, so they were never cached or shared."""
        keep = self.blocks_needed(num_tokens)
        if len(request.block_ids) > keep:
            extra = request.block_ids[keep:]
            del request.block_ids[keep:]
            self.pool.release(extra)
            if self.window is not None:
                self.window.trim(request, keep)

    def cache_blocks(self, request: Request) -> None:
        """Put the request's newly filled (computed) blocks in the tree. Where another request cached the same
        tokens first, switch to its block and free the duplicate. A state snapshot taken at the end of a cached
        block joins it."""
        if self.tree is None or request.request_id in self._private or request.pools:  # an embedding keeps no KV
            return
        self._cache_full_blocks(request)
        if request.state_save is not None and request.num_computed_tokens >= request.state_save[1]:
            (row, end), request.state_save = request.state_save, None
            if end // self.block_size <= request.num_cached_blocks:
                self.snapshots.attach(request.block_ids[end // self.block_size - 1], row)
            else:
                self.snapshots.give_back(row)

    def plan_snapshots(self, chunks: list[Chunk]) -> None:
        """The step's chunks as they run with state snapshots: a prompt chunk that would run past the prompt's last
        block boundary stops there (its state there is the snapshot a later request with this prompt starts from),
        and every chunk ending at a block boundary gets a snapshot row, copied after the step (none where no row is
        free or can be taken over)."""
        bs = self.block_size
        for chunk in chunks:
            request, start = chunk.request, chunk.request.num_computed_tokens
            if request.pools:  # an embedding keeps no KV, so no state for a later hit either
                continue
            last = request.num_prompt_tokens // bs * bs
            if start < last < start + chunk.num_new_tokens:
                chunk.num_new_tokens = last - start
            end = start + chunk.num_new_tokens
            if (chunk.num_new_tokens and end % bs == 0 and request.state_save is None
                    and request.request_id not in self._private):
                row = self.snapshots.take()
                if row is not None:
                    request.state_save = (row, end)

    def state_loaded(self, request: Request) -> None:
        """The request's slot now holds its hit's snapshot: the snapshot may be taken over again."""
        if request.state_load is not None:
            self.snapshots.done_reading(request.state_load)
            request.state_load = None

    def _cache_full_blocks(self, request: Request) -> None:
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = request.num_cached_blocks
        if full <= start:
            return
        bs = self.block_size
        tokens = request.tokens_slice(start * bs, full * bs)
        mine = request.block_ids[start:full]
        node, kept = self.tree.insert(request.cache_namespace, request.cache_node, tokens, mine)
        self.tree.lock(node)
        self.tree.unlock(request.cache_node)
        self.pool.mark_cached(kept)
        for i, (own, tree_block) in enumerate(zip(mine, kept)):
            if own != tree_block:
                self.pool.share([tree_block])
                self.pool.release([own])
                request.block_ids[start + i] = tree_block
            if self.window is not None:
                self.window.cache(request, start + i, tree_block)
        request.cache_node, request.num_cached_blocks = node, full

    def free(self, request: Request) -> None:
        """Idempotent: a second call finds no blocks and does nothing. With prefix caching, the request's computed
        full blocks stay cached (unlocked) for later requests."""
        if request.block_ids:
            self.cache_blocks(request)
        if request.cache_node is not None:
            self.tree.unlock(request.cache_node)
        request.cache_node, request.num_cached_blocks = None, 0
        if self.window is not None:
            self.window.release_all(request)
        blocks, request.block_ids = request.block_ids, []
        if blocks:
            self.pool.release(blocks)
        if self.snapshots is not None:
            self.state_loaded(request)
            if request.state_save is not None:  # taken after a step that did not run or was not kept
                self.snapshots.give_back(request.state_save[0])
                request.state_save = None
        if self.state is not None:
            self.state.give_back(request)
        self._private.discard(request.request_id)

    def check_idle(self) -> None:
        """With no request holding anything: the pool is whole and the tree has no locks."""
        self.pool.check_whole()
        if self.state is not None:
            self.state.check_idle()
        assert not self._private, "a request's private mark outlived it"
        if self.tree is not None:
            self.tree.check()
            assert self.tree.evictable_blocks == self.tree.cached_blocks, "a lock outlived its request"
            cached = self.tree.block_ids()
            if self.snapshots is not None:
                self.snapshots.check_idle(set(cached))
            if self.window is not None:
                cached += self.window.check_idle(set(cached))
            assert sorted(cached) == [b for b in range(self.pool.num_blocks) if self.pool.cached[b]]
