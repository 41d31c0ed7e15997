"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the chat path.

A request becomes a ChatCompletionRequest (system, text / tool_use / tool_result blocks, tools, tool_choice,
stop_sequences, sampling fields), so it is validated, templated, constrained and parsed exactly as a chat request;
the chat writer's answer becomes a Message, and its chunks become Anthropic's events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors on these routes take Anthropic's shape
(server/errors.py anthropic_error).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ValidationError

from tokenmill.errors import InvalidRequest
from tokenmill.server.json_body import first_error
from tokenmill.server.protocol import ChatCompletionRequest, _Body, text_of

# chat finish_reason -> Anthropic's stop_reason (a stop string matched: "stop_sequence", see _stop_reason)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = {"type": "object"}


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    model: str | None = None
    max_tokens: int | None = None  # required on /v1/messages, not on count_tokens
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled"}: the chat template's enable_thinking

    def to_chat(self, for_generation: bool = True) -> ChatCompletionRequest:
        """The same request as a chat completion (400 naming Anthropic's field where something is off)."""
        if for_generation and self.max_tokens is None:
            raise InvalidRequest("max_tokens is required", param="max_tokens")
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise InvalidRequest("temperature must be in [0, 1]", param="temperature")
        body: dict[str, Any] = {
            "model": self.model, "messages": self._chat_messages(), "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
            "stream": self.stream, "stream_options": {"include_usage": True} if self.stream else None}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                               "parameters": t.input_schema}} for t in self.tools]
            body["tool_choice"], body["parallel_tool_calls"] = self._tool_choice()
        if self.messages and self.messages[-1].role == "assistant":  # a prefilled answer: the model goes on with it
            body["add_generation_prompt"], body["continue_final_message"] = False, True
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.get("type") == "enabled"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise InvalidRequest(first_error(e)) from e

    def _tool_choice(self) -> tuple[Any, bool]:
        choice = self.tool_choice or {"type": "auto"}
        kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
        if kind == "auto":
            return "auto", parallel
        if kind == "any":
            return "required", parallel
        if kind == "none":
            return "none", parallel
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        raise InvalidRequest("tool_choice.type must be auto, any, none, or tool with a name", param="tool_choice")

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            out.append({"role": "system", "content": text_of(self.system, "system")})
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls, results = [], [], []
            for j, block in enumerate(m.content):
                where, kind = f"messages.{i}.content.{j}", block.get("type")
                if kind == "text":
                    texts.append(text_of([block], where))
                elif kind == "tool_use" and m.role == "assistant":
                    calls.append(_tool_use_call(block, where))
                elif kind == "tool_result" and m.role == "user":
                    if not isinstance(block.get("tool_use_id"), str):
                        raise InvalidRequest(f"{where}.tool_use_id must be a string", param=f"{where}.tool_use_id")
                    content = block.get("content", "")
                    results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                    "content": text_of(content, f"{where}.content")})
                elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                    continue  # earlier reasoning is not sent back to the model
                else:
                    raise InvalidRequest(f"{where}: a {m.role} message's block of type {kind!r} is not supported "
                                         "(text, tool_use from the assistant, tool_result from the user)",
                                         param=where)
            out.extend(results)  # the answers to the assistant's calls, then whatever the user adds
            if texts or calls or not results:
                message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
                if calls:
                    message["tool_calls"] = calls
                out.append(message)
        return out


def _tool_use_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidRequest(f"{where}: a tool_use block needs a string id and name", param=where)
    if not isinstance(block.get("input", {}), dict):
        raise InvalidRequest(f"{where}.input must be an object", param=f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}}


def _usage(usage: dict) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache, beside
    cache_read_input_tokens (their sum is the prompt)."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop_reason(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def message_body(chat: dict, message_id: str) -> dict:
    """A chat completion (ChatWriter.response) as Anthropic's Message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": _tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {"id": message_id, "type": "message", "role": "assistant", "model": chat["model"], "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(chat["usage"])}


async def message_events(chunks: AsyncIterator[dict], message_id: str, model: str, prompt_tokens: int
                         ) -> AsyncIterator[tuple[str, dict]]:
    """The chat writer's chunks (with the usage chunk last) as Anthropic's stream: (event name, data)."""
    yield "message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}
    index, open_kind, open_call = -1, None, None  # the content block being streamed
    stop: tuple[str, str | None] = ("end_turn", None)

    def start(kind: str, block: dict):
        nonlocal index, open_kind
        index, open_kind = index + 1, kind
        return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}

    def close():
        nonlocal open_kind, open_call
        open_kind, open_call = None, None
        return "content_block_stop", {"type": "content_block_stop", "index": index}

    async for chunk in chunks:
        if chunk.get("usage") is not None and not chunk["choices"]:
            if open_kind is not None:
                yield close()
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                    "usage": {"output_tokens": chunk["usage"]["completion_tokens"]}}
            continue
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if open_kind != "thinking":
                    if open_kind is not None:
                        yield close()
                    yield start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": thinking}
            if delta.get("content"):
                if open_kind != "text":
                    if open_kind is not None:
                        yield close()
                    yield start("text", {"type": "text", "text": ""})
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": delta["content"]}}
            for call in delta.get("tool_calls") or []:
                if call.get("id") is not None and call["index"] != open_call:
                    if open_kind is not None:
                        yield close()
                    yield start("tool_use", {"type": "tool_use", "id": call["id"],
                                             "name": call["function"]["name"], "input": {}})
                    open_call = call["index"]
                arguments = call.get("function", {}).get("arguments")
                if arguments:
                    yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                                  "delta": {"type": "input_json_delta", "partial_json": arguments}}
            if choice.get("finish_reason") is not None:
                stop = _stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    yield "message_stop", {"type": "message_stop"}
