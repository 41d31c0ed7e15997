"""The OpenAI response bodies and stream chunks of completions and chat completions, built from SampleDeltas."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator

from tokenmill.engine.output_processor import RequestState, SampleDelta
from tokenmill.engine.output_stream import OutputStream
from tokenmill.server.reasoning import ReasoningStream, split_reasoning
from tokenmill.server.streaming import Choice
from tokenmill.server.token_text import TokenText
from tokenmill.server.tools import CallStream, Tool, parse_calls


def _usage(prompt_tokens: int, completion_tokens: int, stream: OutputStream,
           reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens served from the prefix cache; reasoning_tokens (with a reasoning
    parser): the completion tokens of the deltas that made up <think> blocks."""
    cached_tokens = stream.num_cached_tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _with_transfer(body: dict, stream: OutputStream) -> dict:
    """A producer's answer carries its KV transfer's outcome (vLLM's `kv_transfer_params`), for the router."""
    transfer = stream.requests[0].kv_transfer if stream.requests else None
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    return body


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _top(lp: dict[int, float], token: int, n: int) -> dict[int, float]:
    """A prompt token's entry cut to that token and the n most likely (the engine computed the largest N asked)."""
    return {token: lp[token], **dict(sorted(lp.items(), key=lambda kv: -kv[1])[:n])}


def vllm_prompt_logprobs(state: RequestState, n: int, tt: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: null, then per prompt token {"<token id>": {"logprob",
    "decoded_token"}} for that token and the n most likely."""
    return [None if lp is None else {str(t): {"logprob": _lp(v), "decoded_token": tt.text(t)}
                                     for t, v in _top(lp, tid, n).items()}
            for tid, lp in zip(state.prompt_token_ids, state.prompt_logprobs or [])]


class _Writer:
    """What completion and chat responses share: the chunk envelope and the closing usage chunk."""

    chunk_object = ""

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def _usage_chunk(self, prompt_tokens: int, completion_tokens: int, stream: OutputStream,
                     reasoning_tokens: int | None = None) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = _usage(prompt_tokens, completion_tokens, stream, reasoning_tokens)
        return chunk


class CompletionWriter(_Writer):
    """With echo and logprobs (OpenAI) the prompt tokens' logprobs lead each choice's `logprobs`, the first token's
    null; with `prompt_logprobs` (vLLM) each choice also gets a `prompt_logprobs` list: null, then per prompt token
    {"<token id>": {"logprob", "decoded_token"}} for that token and the top-N. Streamed, a prompt's echo chunks wait
    until its prompt logprobs are complete; `prompt_logprobs` itself is refused with stream: true (protocol.py)."""

    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, n: int, logprobs: int | None, echo: list[str] | None,
                 token_text: TokenText, prompt_logprobs: int | None = None):
        self.id, self.model, self.n, self.logprobs, self.echo, self.tt = request_id, model, n, logprobs, echo, token_text
        self.prompt_logprobs = prompt_logprobs
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}

    @property
    def echoes_logprobs(self) -> bool:
        return self.echo is not None and self.logprobs is not None

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

    def _echo_logprobs(self, state: RequestState) -> dict:
        """The prompt tokens in OpenAI's logprobs shape; the first has no context, so null."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for tid, lp in zip(state.prompt_token_ids, state.prompt_logprobs or []):
            s = self.tt.text(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if lp is None else _lp(lp[tid]))
            out["top_logprobs"].append(None if lp is None else {
                self.tt.text(t): _lp(v) for t, v in _top(lp, tid, self.logprobs).items()})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def _choice(self, index: int, text: str, token_ids, lps, finish_reason, stop_reason) -> dict:
        return {"index": index, "text": text,
                "logprobs": self._logprobs(index, token_ids, lps) if self.logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def _echo_choice(self, index: int, state: RequestState | None) -> dict:
        """The first chunk of a streamed choice with echo: the prompt's text (and its logprobs)."""
        return {"index": index, "text": self.echo[index // self.n],
                "logprobs": self._echo_logprobs(state) if state is not None else None,
                "finish_reason": None, "stop_reason": None}

    def response(self, choices: list[Choice], prompt_tokens: int, stream: OutputStream) -> dict:
        body = []
        for i, c in enumerate(choices):
            state = stream.requests[i // self.n]
            text = "".join(c.text)
            if self.echo:
                text = self.echo[i // self.n] + text
            choice = self._choice(i, text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            if self.echoes_logprobs:
                prompt = self._echo_logprobs(state)
                choice["logprobs"] = {k: prompt[k] + v for k, v in choice["logprobs"].items()}
            if self.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(state, self.prompt_logprobs, self.tt)
            body.append(choice)
        return _with_transfer({"id": self.id, "object": "text_completion", "created": self.created,
                               "model": self.model, "choices": body,
                               "usage": _usage(prompt_tokens, sum(len(c.token_ids) for c in choices), stream)}, stream)

    async def chunks(self, stream: OutputStream, usage_prompt: int | None) -> AsyncIterator[dict]:
        completion_tokens = 0
        waiting: set[int] = set()  # prompts whose echo chunks wait for their prompt logprobs
        held: dict[int, list[dict]] = {}  # their samples' choices meanwhile (a sample other than the first)
        if self.echoes_logprobs:
            waiting = set(range(len(stream.requests)))
        elif self.echo:
            for i in range(len(stream.requests) * self.n):
                yield self._chunk([self._echo_choice(i, None)])
        async for update in stream:
            choices = []
            for d in update.samples:
                index = update.prompt_index * self.n + d.index
                completion_tokens += len(d.token_ids)
                if d.text or d.finish_reason is not None or (self.logprobs is not None and d.token_ids):
                    choices.append(self._choice(index, d.text, d.token_ids, d.logprobs or [], d.finish_reason,
                                                d.stop_reason))
            p = update.prompt_index
            if p in waiting:
                state = stream.requests[p]
                if not update.finished and len(state.prompt_logprobs or ()) < len(state.prompt_token_ids):
                    held.setdefault(p, []).extend(choices)
                    continue
                waiting.discard(p)
                for j in range(self.n):
                    yield self._chunk([self._echo_choice(p * self.n + j, state)])
                choices = held.pop(p, []) + choices
            if choices:
                yield self._chunk(choices)
        if usage_prompt is not None:
            yield self._usage_chunk(usage_prompt, completion_tokens, stream)


class ChatWriter(_Writer):
    """With a reasoning parser (server/reasoning.py) the <think> block goes to `reasoning_content` first, and tool
    calls are parsed out of the rest (the content) only."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None, token_text: TokenText,
                 prompt_logprobs: int | None = None, tools: tuple[Tool, ...] | None = None,
                 reasoning_parser: str | None = None, echo: str | None = None):
        self.id, self.model, self.n, self.top, self.tt = request_id, model, n, top_logprobs, token_text
        self.echo = echo  # echo: the last (assistant) message's text each answer starts with
        self.prompt_logprobs = prompt_logprobs  # vLLM's `prompt_logprobs` list in each choice (not streamed)
        self.tools = tools  # offered tools whose calls are parsed out of the text (server/tools.py); None: no parsing
        self.reasoning_parser = reasoning_parser  # None: the text is all content
        self.created = int(time.time())

    def _message(self, c: Choice) -> tuple[dict, str | None, int]:
        """The assistant message of a whole choice (reasoning split off, tool calls parsed out), its finish_reason
        and its reasoning tokens."""
        message: dict = {"role": "assistant"}
        text, reasoning_tokens = "".join(c.text), 0
        if self.reasoning_parser:
            reasoning, text, reasoning_tokens = split_reasoning(self.reasoning_parser, c.text, c.sizes)
            message["reasoning_content"] = reasoning
        content, calls = parse_calls(text, self.tools) if self.tools else (text, [])
        found = message.get("reasoning_content") is not None
        message["content"] = (content or None) if found or calls else content  # as before without a block
        if self.echo:
            message["content"] = self.echo + (message["content"] or "")
        if not calls:
            return message, c.finish_reason, reasoning_tokens
        message["tool_calls"] = calls
        return message, "tool_calls" if c.finish_reason == "stop" else c.finish_reason, reasoning_tokens

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]]) -> dict:
        content = []
        for tid, lp in zip(token_ids, lps):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top]
            content.append({"token": self.tt.text(tid), "logprob": _lp(lp[tid]), "bytes": self.tt.bytes(tid),
                            "top_logprobs": [{"token": self.tt.text(t), "logprob": _lp(v), "bytes": self.tt.bytes(t)}
                                             for t, v in top]})
        return {"content": content}

    def response(self, choices: list[Choice], prompt_tokens: int, stream: OutputStream) -> dict:
        body, reasoning_tokens = [], 0
        for i, c in enumerate(choices):
            message, finish_reason, reasoned = self._message(c)
            reasoning_tokens += reasoned
            body.append({"index": i, "message": message,
                         "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.top is not None else None,
                         "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        if self.prompt_logprobs is not None:
            for choice in body:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(stream.requests[0], self.prompt_logprobs, self.tt)
        usage = _usage(prompt_tokens, sum(len(c.token_ids) for c in choices), stream,
                       reasoning_tokens if self.reasoning_parser else None)
        return _with_transfer({"id": self.id, "object": "chat.completion", "created": self.created,
                               "model": self.model, "choices": body, "usage": usage}, stream)

    def _deltas(self, d: SampleDelta, calls: dict[int, CallStream] | None,
                reasoners: dict[int, ReasoningStream] | None) -> list[dict]:
        """A sample delta's text as chat deltas: reasoning, content, tool calls (what is held back goes at the
        end)."""
        if reasoners is None:
            pieces = [("content", d.text)]
        else:
            r = reasoners[d.index]
            pieces = r.feed(d.text, len(d.token_ids)) + (r.finish() if d.finish_reason is not None else [])
        deltas = []
        for kind, text in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning_content": text})
            elif calls is not None:  # tool calls split out of the content as their blocks close
                deltas += calls[d.index].feed(text)
            elif text:
                deltas.append({"content": text})
        if calls is not None and d.finish_reason is not None:
            deltas += calls[d.index].finish()
        return deltas

    async def chunks(self, stream: OutputStream, usage_prompt: int | None) -> AsyncIterator[dict]:
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.n)])
        if self.echo:
            yield self._chunk([{"index": i, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}
                               for i in range(self.n)])
        completion_tokens = 0
        calls = {i: CallStream(self.tools) for i in range(self.n)} if self.tools else None
        parser = self.reasoning_parser
        reasoners = {i: ReasoningStream(parser) for i in range(self.n)} if parser else None
        async for update in stream:
            content, finished = [], []
            for d in update.samples:
                completion_tokens += len(d.token_ids)
                lps = self._logprobs(d.token_ids, d.logprobs or []) if self.top is not None and d.token_ids else None
                deltas = self._deltas(d, calls, reasoners)
                for j, delta in enumerate(deltas or ([{"content": ""}] if lps else [])):
                    content.append({"index": d.index, "delta": delta, "logprobs": lps if j == 0 else None,
                                    "finish_reason": None})
                if d.finish_reason is not None:
                    called = calls is not None and calls[d.index].num_calls and d.finish_reason == "stop"
                    reason = "tool_calls" if called else d.finish_reason
                    finished.append({"index": d.index, "delta": {}, "logprobs": None,
                                     "finish_reason": reason, "stop_reason": d.stop_reason})
            for choices in (content, finished):  # content first, then the end
                for chunk in _one_per_choice(choices):
                    yield self._chunk(chunk)
        if usage_prompt is not None:
            reasoning_tokens = sum(r.reasoning_tokens for r in reasoners.values()) if reasoners else None
            yield self._usage_chunk(usage_prompt, completion_tokens, stream, reasoning_tokens)


def _one_per_choice(entries: list[dict]) -> list[list[dict]]:
    """Choice entries as chunks holding at most one entry per choice, in order (a chunk's choices are distinct)."""
    chunks: list[list[dict]] = []
    for entry in entries:
        if not chunks or any(e["index"] == entry["index"] for e in chunks[-1]):
            chunks.append([])
        chunks[-1].append(entry)
    return chunks
