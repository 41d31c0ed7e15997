"""The OpenAI response bodies and stream chunks of completions and chat completions, built from SampleDeltas."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

from tokenmill.engine.async_engine import OutputStream
from tokenmill.server.streaming import Choice
from tokenmill.server.token_text import TokenText


def _usage(prompt_tokens: int, completion_tokens: int, stream: OutputStream) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens served from the prefix cache."""
    cached_tokens = stream.num_cached_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class _Writer:
    """What completion and chat responses share: the chunk envelope and the closing usage chunk."""

    chunk_object = ""

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def _usage_chunk(self, prompt_tokens: int, completion_tokens: int, stream: OutputStream) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = _usage(prompt_tokens, completion_tokens, stream)
        return chunk


class CompletionWriter(_Writer):
    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, n: int, logprobs: int | None, echo: list[str] | None,
                 token_text: TokenText):
        self.id, self.model, self.n, self.logprobs, self.echo, self.tt = request_id, model, n, logprobs, echo, token_text
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}

    def _logprobs(self, index: int, token_ids: list[int], lps: list[dict[int, float]]) -> dict:
        offset = self.offsets.get(index)
        if offset is None:
            offset = len(self.echo[index // self.n]) if self.echo else 0
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, lps):
            s = self.tt.text(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(lp[tid]))
            out["top_logprobs"].append({self.tt.text(t): _lp(v) for t, v in lp.items()})
            out["text_offset"].append(offset)
            offset += len(s)
        self.offsets[index] = offset
        return out

    def _choice(self, index: int, text: str, token_ids, lps, finish_reason, stop_reason) -> dict:
        return {"index": index, "text": text,
                "logprobs": self._logprobs(index, token_ids, lps) if self.logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def response(self, choices: list[Choice], prompt_tokens: int, stream: OutputStream) -> dict:
        body = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            if self.echo:
                text = self.echo[i // self.n] + text
            body.append(self._choice(i, text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason))
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": body, "usage": _usage(prompt_tokens, sum(len(c.token_ids) for c in choices), stream)}

    async def chunks(self, stream: OutputStream, usage_prompt: int | None) -> AsyncIterator[dict]:
        completion_tokens = 0
        if self.echo:
            for i in range(len(stream.requests) * self.n):
                yield self._chunk([self._choice(i, self.echo[i // self.n], [], [], None, None)])
        async for update in stream:
            choices = []
            for d in update.samples:
                index = update.prompt_index * self.n + d.index
                completion_tokens += len(d.token_ids)
                if d.text or d.finish_reason is not None or (self.logprobs is not None and d.token_ids):
                    choices.append(self._choice(index, d.text, d.token_ids, d.logprobs or [], d.finish_reason,
                                                d.stop_reason))
            if choices:
                yield self._chunk(choices)
        if usage_prompt is not None:
            yield self._usage_chunk(usage_prompt, completion_tokens, stream)


class ChatWriter(_Writer):
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None, token_text: TokenText):
        self.id, self.model, self.n, self.top, self.tt = request_id, model, n, top_logprobs, token_text
        self.created = int(time.time())

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]]) -> dict:
        content = []
        for tid, lp in zip(token_ids, lps):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top]
            content.append({"token": self.tt.text(tid), "logprob": _lp(lp[tid]), "bytes": self.tt.bytes(tid),
                            "top_logprobs": [{"token": self.tt.text(t), "logprob": _lp(v), "bytes": self.tt.bytes(t)}
                                             for t, v in top]})
        return {"content": content}

    def response(self, choices: list[Choice], prompt_tokens: int, stream: OutputStream) -> dict:
        body = [{"index": i, "message": {"role": "assistant", "content": "".join(c.text)},
                 "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.top is not None else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for i, c in enumerate(choices)]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": body, "usage": _usage(prompt_tokens, sum(len(c.token_ids) for c in choices), stream)}

    async def chunks(self, stream: OutputStream, usage_prompt: int | None) -> AsyncIterator[dict]:
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.n)])
        completion_tokens = 0
        async for update in stream:
            content, finished = [], []
            for d in update.samples:
                completion_tokens += len(d.token_ids)
                lps = self._logprobs(d.token_ids, d.logprobs or []) if self.top is not None and d.token_ids else None
                if d.text or lps:
                    content.append({"index": d.index, "delta": {"content": d.text}, "logprobs": lps,
                                    "finish_reason": None})
                if d.finish_reason is not None:
                    finished.append({"index": d.index, "delta": {}, "logprobs": None,
                                     "finish_reason": d.finish_reason, "stop_reason": d.stop_reason})
            for choices in (content, finished):  # one entry per choice in a chunk: content first, then the end
                if choices:
                    yield self._chunk(choices)
        if usage_prompt is not None:
            yield self._usage_chunk(usage_prompt, completion_tokens, stream)
