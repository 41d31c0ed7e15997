"""Incremental detokenization and stop strings, on the frontend side (the engine core never handles text)."""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# Decode a few tokens before the new ones so that merges across the boundary (leading spaces, multi-byte
# characters) come out as the full decode would give them.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings.

    `text` is the output so far (truncated at a stop string, which is dropped unless asked for). While a stop
    string could still be completing, the tail that might be its start is held back from `visible_text`.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop, self.include_stop, self.skip = stop, include_stop, skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0  # length of visible text handed out so far
        self.stopped_by: str | None = None
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.num_used = 0  # see append

    def append(self, token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string when one now ends the output. Then `num_used` says how many of
        `token_ids` it took to complete it (the rest come after the end: several arrive at once with speculation)."""
        self.num_used = 0
        if self.stopped_by is not None:
            return self.stopped_by
        for t in token_ids:
            self.num_used += 1
            self.ids.append(t)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
            full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self.stop and self._find_stop(start):
                    return self.stopped_by
        return None

    def _find_stop(self, new_from: int) -> bool:
        search_from = max(0, new_from - self._hold)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return True

    def visible_text(self, finished: bool) -> str:
        """The output so far, minus a tail that could still turn out to start a stop string (unless finished).
        It only grows, so streaming consumers send what is past their last length."""
        if finished or self.stopped_by is not None or not self._hold:
            return self.text
        self.emitted = max(self.emitted, len(self.text) - self._hold)
        return self.text[: self.emitted]
