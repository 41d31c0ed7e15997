"""WindowPages: the window layers' pages of each block (engine/kv_layout.py's hybrid layout), for KVCacheManager.

A request holds, for each of its blocks, its full-attention page (`Request.block_ids`, as with any layout) and,
while the block is inside its window, `num_window_tables` window pages (`Request.window_pages`; None once
released). After each step `slide` gives back the window pages of blocks no future token reads.

With prefix caching a cached block's window pages are cached beside its full page, keyed by that full page
(`_cached`): a later request hitting the prefix needs them for the blocks inside the window at the hit's end, so
`hit_blocks` shortens a hit until they are all there. Cached window pages no request holds (`_idle`, oldest
release first) are reclaimable on their own, without evicting their block from the radix tree: a long prompt's
early blocks keep only their full page in the cache while a shared prefix stays matchable where its window is.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.block_pool import BlockPool
    from tokenmill.engine.kv_layout import KVLayout
    from tokenmill.request import Request


class WindowPages:
    def __init__(self, pool: BlockPool, layout: KVLayout):
        self.pool, self.layout = pool, layout
        self.per_block = layout.num_window_tables
        self._cached: dict[int, list[int]] = {}  # full page of a cached block -> its cached window pages
        self._idle: OrderedDict[int, None] = OrderedDict()  # those of `_cached` no request holds, oldest first

    @property
    def num_idle_pages(self) -> int:
        return self.per_block * len(self._idle)

    # ---- a request's blocks --------------------------------------------------------------------------------
    def extend(self, request: Request, pages: list[int]) -> None:
        """The window pages of the request's new blocks, `per_block` each, in block order."""
        k = self.per_block
        request.window_pages.extend(pages[i:i + k] for i in range(0, len(pages), k))

    def slide(self, request: Request) -> None:
        """Give back the window pages of the blocks that left the window of every token from
        `num_computed_tokens` on."""
        first = min(self.layout.first_window_block(request.num_computed_tokens), len(request.window_pages))
        for b in range(request.num_window_released, first):
            self._drop(request, b)
        request.num_window_released = max(request.num_window_released, first)

    def trim(self, request: Request, keep: int) -> None:
        """Give back the window pages of blocks past the first `keep` (never cached: they hold no computed token)."""
        for pages in request.window_pages[keep:]:
            if pages is not None:
                self.pool.release(pages)
        del request.window_pages[keep:]

    def release_all(self, request: Request) -> None:
        for b in range(len(request.window_pages)):
            self._drop(request, b)
        request.window_pages, request.num_window_released = [], 0

    def _drop(self, request: Request, b: int) -> None:
        pages = request.window_pages[b]
        if pages is None:
            return
        request.window_pages[b] = None
        self.pool.release(pages)
        full = request.block_ids[b]
        if self._cached.get(full) is pages and self.pool.ref_counts[pages[0]] == 0:
            self._idle[full] = None  # the newest idle: reclaimed last

    # ---- prefix caching --------------------------------------------------------------------------------------
    def cache(self, request: Request, b: int, tree_page: int) -> None:
        """Block `b` of `request` joined the radix tree, which keeps `tree_page` for it (another request's page
        for the same tokens, or the request's own). Its window pages, if it still holds them,
        join the cache; or, where the tree's block has cached window pages already, it takes those instead."""
        mine = request.window_pages[b]
        theirs = self._cached.get(tree_page)
        if theirs is not None and mine is not theirs:
            if mine is not None:
                self._share(tree_page, theirs)
                self.pool.release(mine)
                request.window_pages[b] = theirs
        elif mine is not None and theirs is None:
            self.pool.mark_cached(mine)
            self._cached[tree_page] = mine

    def hit_blocks(self, blocks: list[int]) -> int:
        """How many of these cached blocks (a radix-tree match) a hit may take: the most whose window's blocks at
        the end all have their window pages cached."""
        bs, runs, run = self.layout.block_size, [], 0
        for full in blocks:  # runs[i]: how many blocks up to i in a row have their window pages cached
            run = run + 1 if full in self._cached else 0
            runs.append(run)
        for n in range(len(blocks), 0, -1):
            if n - self.layout.first_window_block(n * bs) <= runs[n - 1]:
                return n
        return 0

    def idle_in_hit(self, blocks: list[int]) -> int:
        """How many idle (reclaimable) window pages a hit on `blocks` would take: they stop being reclaimable."""
        first = self.layout.first_window_block(len(blocks) * self.layout.block_size)
        return self.per_block * sum(1 for f in blocks[first:] if f in self._idle)

    def take_hit(self, request: Request, blocks: list[int]) -> None:
        """A request admitted with the cached prefix `blocks` holds the window pages of those inside its window."""
        first = self.layout.first_window_block(len(blocks) * self.layout.block_size)
        request.window_pages = [None] * first
        for f in blocks[first:]:
            pages = self._cached[f]
            self._share(f, pages)
            request.window_pages.append(pages)
        request.num_window_released = first

    def _share(self, full: int, pages: list[int]) -> None:
        self.pool.share(pages)
        self._idle.pop(full, None)

    # ---- reclaiming ------------------------------------------------------------------------------------------
    def reclaim(self, num_pages: int) -> int:
        """Free idle cached window pages, oldest first, until `num_pages` are free or none is left; returns how
        many were freed."""
        freed = 0
        while freed < num_pages and self._idle:
            full, _ = self._idle.popitem(last=False)
            pages = self._cached.pop(full)
            self.pool.uncache(pages)
            freed += len(pages)
        return freed

    def forget(self, full_pages: list[int]) -> int:
        """The radix tree evicted these blocks: their cached window pages (idle, as no one holds the block) go
        too; returns how many."""
        freed = 0
        for full in full_pages:
            pages = self._cached.pop(full, None)
            if pages is not None:
                del self._idle[full]
                self.pool.uncache(pages)
                freed += len(pages)
        return freed

    def check_idle(self, tree_blocks: set[int]) -> list[int]:
        """With no request running: every cached window page idle, each under a block the tree holds. Returns the
        cached window pages."""
        assert set(self._idle) == set(self._cached), "a cached window page held with nothing running"
        assert set(self._cached) <= tree_blocks, "window pages cached under a block the tree dropped"
        return [p for pages in self._cached.values() for p in pages]
