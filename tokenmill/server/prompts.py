"""Request text -> token ids for the endpoints: tokenizing and chat-template rendering, off the event loop when the
text is long, so one big prompt does not stall every stream."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenmill.errors import InvalidRequest
from tokenmill.tokenizer import Tokenizer

# Texts longer than this are tokenized (and chat templates rendered) in a worker thread, off the event loop.
INLINE_TOKENIZE_CHARS = 2048


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tok.encode, text, add_special_tokens)
        return self.tok.encode(text, add_special_tokens)

    async def prompts(self, raw: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        """Completion prompts (texts or token ids) as (text or None, ids) pairs, the texts encoded in one go."""
        texts = [p for p in raw if isinstance(p, str)]
        if sum(map(len, texts)) > INLINE_TOKENIZE_CHARS:
            encoded = iter(await asyncio.to_thread(lambda: [self.tok.encode(t) for t in texts]))
        else:
            encoded = iter([self.tok.encode(t) for t in texts])
        return [(p, next(encoded)) if isinstance(p, str) else (None, p) for p in raw]

    async def infill(self, raw: list[str | list[int]], suffix: str, model: str) -> list[tuple[str, list[int]]]:
        """Completion prompts with a `suffix`: each prompt text the prefix of a fill-in-the-middle prompt (400 where
        the model has no FIM tokens, or a prompt is token ids)."""
        if self.tok.fim_token_ids is None:
            raise InvalidRequest(f"suffix needs a fill-in-the-middle model; {model!r} has no FIM tokens "
                                 "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> or a GGUF's fim_*_token_id)",
                                 param="suffix")
        if not all(isinstance(p, str) for p in raw):
            raise InvalidRequest("suffix takes text prompts, not token ids", param="suffix")
        return await asyncio.to_thread(lambda: [(p, self.tok.infill(p, suffix)) for p in raw])

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          continue_final_message: bool = False) -> tuple[str, list[int]]:
        """The chat template's text and its ids; a template that raises is the client's error (400)."""
        def work() -> tuple[str, list[int]]:
            try:
                text = self.tok.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                            template_kwargs=template_kwargs,
                                            continue_final_message=continue_final_message)
            except Exception as e:  # noqa: BLE001 - whatever a template raises, the messages caused it
                raise InvalidRequest(f"the chat template rejected the messages: {e}", param="messages") from None
            return text, self.tok.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(work)

    async def decode(self, token_ids: list[int]) -> str:
        if len(token_ids) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(self.tok.decode, token_ids, False)
        return self.tok.decode(token_ids, skip_special_tokens=False)
