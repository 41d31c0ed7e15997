"""Reasoning parsers (`tokenmill serve --reasoning-parser`, vLLM's names): a chat answer's `<think>...</think>` block
goes to `message.reasoning_content`, the rest to `message.content`, whole or streamed.

- deepseek_r1: the template may already have opened the block, so the output starts inside it (a leading `<think>`
  is dropped); everything up to `</think>` is reasoning, and with no `</think>` at all, all of it is.
- qwen3: reasoning only where the model writes `<think>` (with `enable_thinking: false` the template closes an empty
  block itself and the output has none); text before it stays content; an unclosed block is reasoning to the end.
Only the first block is parsed; later tags are text. The tags never reach the client. One state machine serves both
the streamed deltas and the whole response (the whole is the stream fed at once), so the two always agree; text that
may be the start of a tag is held back until the next delta says (as stop strings are).
"""

from __future__ import annotations

from collections.abc import Iterable

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")

# where a stream is: before a block (content flows, watching for OPEN), at the very start of a deepseek_r1 output
# (an optional OPEN), inside the block (reasoning flows, watching for CLOSE), after it (content, nothing parsed)
BEFORE, OPENING, INSIDE, AFTER = "before", "opening", "inside", "after"

Piece = tuple[str, str]  # ("reasoning" | "content", text)


class ReasoningStream:
    """One choice's text split into reasoning and content pieces, in order, as it arrives; also counts the tokens
    of the deltas that were part of the block (`reasoning_tokens`, for usage)."""

    def __init__(self, parser: str):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(REASONING_PARSERS)}")
        self.state = OPENING if parser == "deepseek_r1" else BEFORE
        self.buffer = ""
        self.reasoning_tokens = 0

    @property
    def found(self) -> bool:
        """Whether the output has a reasoning block (deepseek_r1's always does)."""
        return self.state != BEFORE

    def feed(self, text: str, num_tokens: int = 0) -> list[Piece]:
        """The pieces `text` (the next delta, of `num_tokens` tokens) releases."""
        was_after = self.state == AFTER
        self.buffer += text
        out: list[Piece] = []
        while self.buffer:
            if self.state == AFTER:
                _emit(out, "content", self.buffer)
                self.buffer = ""
            elif self.state == OPENING:
                if len(self.buffer) < len(OPEN) and OPEN.startswith(self.buffer):
                    break  # may yet be the opening tag
                if self.buffer.startswith(OPEN):
                    self.buffer = self.buffer[len(OPEN):]
                self.state = INSIDE
            else:
                tag, kind = (OPEN, "content") if self.state == BEFORE else (CLOSE, "reasoning")
                at = self.buffer.find(tag)
                if at < 0:
                    keep = _partial(self.buffer, tag)
                    _emit(out, kind, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                _emit(out, kind, self.buffer[:at])
                self.buffer = self.buffer[at + len(tag):]
                self.state = INSIDE if self.state == BEFORE else AFTER
        if not was_after and self.state != BEFORE:  # the delta touched the block: its tokens are reasoning
            self.reasoning_tokens += num_tokens
        return out

    def finish(self) -> list[Piece]:
        """What is still held at the end: a partial tag is text of where the stream is."""
        rest, self.buffer = self.buffer, ""
        if self.state == OPENING:
            self.state = INSIDE
        out: list[Piece] = []
        _emit(out, "content" if self.state in (BEFORE, AFTER) else "reasoning", rest)
        return out


def split_reasoning(parser: str, texts: Iterable[str], sizes: Iterable[int] = ()) -> tuple[str | None, str, int]:
    """(reasoning or None when there is no block, content, reasoning tokens) of a whole output given as its deltas'
    texts and token counts (or as one text)."""
    stream = ReasoningStream(parser)
    pieces: list[Piece] = []
    sizes = list(sizes)
    for i, text in enumerate([texts] if isinstance(texts, str) else texts):
        pieces += stream.feed(text, sizes[i] if i < len(sizes) else 0)
    pieces += stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.found else None), content, stream.reasoning_tokens


def _emit(out: list[Piece], kind: str, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


def _partial(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
