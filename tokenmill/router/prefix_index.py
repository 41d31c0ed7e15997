"""An approximate index of the prompts sent to each replica (SGLang's cache-aware routing, in the small): a prompt's
text is cut in blocks of BLOCK_CHARS characters, each block named by a hash chained through the blocks before it,
so a name stands for a whole prefix. `match` walks a new prompt's chain and says, per replica, how many leading
characters it has already been sent: the replica whose KV cache most likely holds them. Bounded: the least recently
used prefixes are forgotten first. Plain Python, no tokenizer: routers in front of any server see only text.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_CHARS = 64
MAX_BLOCKS = 200_000  # ~30 MB of index at most


def block_names(text: str) -> list[bytes]:
    """The chained names of the text's whole blocks (a trailing partial block is not indexed)."""
    names, h = [], b""
    for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hashlib.blake2b(h + text[i:i + BLOCK_CHARS].encode("utf-8", "surrogatepass"), digest_size=12).digest()
        names.append(h)
    return names


def _names(prompt: str | Sequence[bytes]) -> Sequence[bytes]:
    """A prompt's block names: given as text, or already computed (off the event loop, for a large prompt)."""
    return block_names(prompt) if isinstance(prompt, str) else prompt


class PrefixIndex:
    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, set[str]] = OrderedDict()  # block name -> replicas sent it

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, prompt: str | Sequence[bytes]) -> dict[str, int]:
        """Per replica, the characters of the prompt's longest prefix it was sent (whole blocks)."""
        best: dict[str, int] = {}
        alive: set[str] | None = None
        for i, name in enumerate(_names(prompt)):
            holders = self._blocks.get(name)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for r in alive:
                best[r] = (i + 1) * BLOCK_CHARS
        return best

    def insert(self, prompt: str | Sequence[bytes], replica: str) -> None:
        for name in _names(prompt):
            holders = self._blocks.get(name)
            if holders is None:
                self._blocks[name] = {replica}
            else:
                holders.add(replica)
                self._blocks.move_to_end(name)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica left (removed, or restarted with an empty cache)."""
        for name in [n for n, holders in self._blocks.items() if replica in holders]:
            holders = self._blocks[name]
            holders.discard(replica)
            if not holders:
                del self._blocks[name]
