"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over the chat path.

A request's `input` (a string, or message / function_call / function_call_output items) after its
`instructions`, and the stored conversation of `previous_response_id` before them, becomes a ChatCompletionRequest,
so it is validated, templated, constrained (`text.format`: json_schema, json_object) and parsed (tool calls,
reasoning) exactly as a chat request. The chat writer's answer becomes a Response whose `output` holds reasoning,
message and function_call items; its chunks become the Responses stream (response.created, .output_item.added,
.content_part.added, .output_text.delta ... .function_call_arguments.delta ... response.completed), with the item
ids the final Response repeats, as the `openai` SDK's `responses.stream` checks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from tokenmill.errors import InvalidRequest
from tokenmill.server.json_body import first_error
from tokenmill.server.protocol import ChatCompletionRequest, _Body, text_of

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (consecutive function_call items make one assistant message's tool_calls)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequest("input must not be empty", param="input")
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            where, kind = f"input.{i}", item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise InvalidRequest(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
                content = text_of(item.get("content"), f"{where}.content", TEXT_PARTS)
                out.append({"role": role, "content": content})
            elif kind == "function_call":
                call = _checked_strings(item, where, ("call_id", "name", "arguments"))
                entry = {"id": call["call_id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}
                if out and out[-1]["role"] == "assistant" and (out[-1].get("tool_calls") or not out[-1]["content"]):
                    out[-1].setdefault("tool_calls", []).append(entry)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [entry]})
            elif kind == "function_call_output":
                _checked_strings(item, where, ("call_id",))
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": text_of(item.get("output"), f"{where}.output", TEXT_PARTS)})
            elif kind == "reasoning":
                continue  # earlier reasoning is not sent back to the model
            else:
                raise InvalidRequest(f"{where}.type {kind!r} is not supported (message, function_call, "
                                     "function_call_output, reasoning)", param=f"{where}.type")
        return out

    def to_chat(self, history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request: instructions, then the stored conversation (`history`), then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model, "messages": system + history + messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stream": self.stream, "stream_options": {"include_usage": True} if self.stream else None,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self._response_format()}
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        body["tool_choice"] = self._tool_choice()  # checked by the chat request (e.g. required without tools)
        if self.reasoning is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.reasoning.get("effort") not in ("none", None)}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise InvalidRequest(first_error(e)) from e

    def _tool_choice(self) -> Any:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequest("tool_choice must be auto, none, required or {type: function, name}",
                             param="tool_choice")

    def _response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
        raise InvalidRequest("text.format.type must be text, json_object or json_schema", param="text.format")


def _checked_strings(item: dict[str, Any], where: str, names: tuple[str, ...]) -> dict[str, Any]:
    for name in names:
        if not isinstance(item.get(name), str):
            raise InvalidRequest(f"{where}.{name} must be a string", param=f"{where}.{name}")
    return item


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidRequest(f"tools.{index}: only function tools ({{type: function, name, parameters}}) are "
                             "supported", param=f"tools.{index}")
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description") or "",
                                             "parameters": tool.get("parameters") or {"type": "object"}}}


class ResponseBuilder:
    """One response's ids, settings and output items, for its body, its stream and the stored conversation."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id, self.created = new_id("resp"), int(time.time())

    def body(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {}}

    @staticmethod
    def usage(chat_usage: dict) -> dict:
        reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": chat_usage["total_tokens"]}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_of(chat: dict) -> tuple[list[dict], str | None]:
    """A chat completion's first choice as Response output items, and its finish_reason."""
    choice = chat["choices"][0]
    message, items = choice["message"], []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items, choice["finish_reason"]


def assistant_messages(output: list[dict]) -> list[dict]:
    """Output items as the chat messages a follow-up's conversation holds (reasoning left out)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def response_events(chunks: AsyncIterator[dict], builder: ResponseBuilder, output: list[dict]
                          ) -> AsyncIterator[tuple[str, dict]]:
    """The chat writer's chunks (usage last) as the Responses stream; `output` collects the finished items (the
    caller stores the conversation from them)."""
    sequence = 0

    def event(kind: str, **fields) -> tuple[str, dict]:
        nonlocal sequence
        sequence += 1
        return kind, {"type": kind, "sequence_number": sequence - 1, **fields}

    yield event("response.created", response=builder.body("in_progress", [], None))
    yield event("response.in_progress", response=builder.body("in_progress", [], None))
    current: dict | None = None  # the item being streamed: {"kind", "id", "text", and a call's "call_id", "name"}
    finish_reason: str | None = None

    def close() -> list[tuple[str, dict]]:
        nonlocal current
        if current is None:
            return []
        at, item_id, text, kind = len(output), current["id"], current["text"], current["kind"]
        events = []
        if kind == "message":
            item = message_item(item_id, text)
            events.append(event("response.output_text.done", item_id=item_id, output_index=at, content_index=0,
                                text=text, logprobs=[]))
            events.append(event("response.content_part.done", item_id=item_id, output_index=at, content_index=0,
                                part=item["content"][0]))
        elif kind == "reasoning":
            item = reasoning_item(item_id, text)
            events.append(event("response.reasoning_text.done", item_id=item_id, output_index=at, content_index=0,
                                text=text))
        else:
            item = call_item(item_id, current["call_id"], current["name"], text)
            events.append(event("response.function_call_arguments.done", item_id=item_id, output_index=at,
                                name=current["name"], arguments=text))
        events.append(event("response.output_item.done", output_index=at, item=item))
        output.append(item)
        current = None
        return events

    def open_item(kind: str, **extra) -> list[tuple[str, dict]]:
        nonlocal current
        events = close()
        item_id = new_id({"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind])
        current = {"kind": kind, "id": item_id, "text": "", **extra}
        at = len(output)
        if kind == "message":
            events.append(event("response.output_item.added", output_index=at,
                                item={**message_item(item_id, "", "in_progress"), "content": []}))
            events.append(event("response.content_part.added", item_id=item_id, output_index=at, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif kind == "reasoning":
            events.append(event("response.output_item.added", output_index=at,
                                item={"type": "reasoning", "id": item_id, "summary": [], "content": []}))
        else:
            events.append(event("response.output_item.added", output_index=at,
                                item=call_item(item_id, extra["call_id"], extra["name"], "", "in_progress")))
        return events

    async for chunk in chunks:
        if chunk.get("usage") is not None and not chunk["choices"]:
            for e in close():
                yield e
            status = ResponseBuilder.status(finish_reason)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield event(kind, response=builder.body(status, list(output), ResponseBuilder.usage(chunk["usage"])))
            continue
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if current is None or current["kind"] != "reasoning":
                    for e in open_item("reasoning"):
                        yield e
                current["text"] += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=current["id"], output_index=len(output),
                            content_index=0, delta=delta["reasoning_content"])
            if delta.get("content"):
                if current is None or current["kind"] != "message":
                    for e in open_item("message"):
                        yield e
                current["text"] += delta["content"]
                yield event("response.output_text.delta", item_id=current["id"], output_index=len(output),
                            content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                if call.get("id") is not None:
                    for e in open_item("function_call", call_id=call["id"], name=call["function"]["name"]):
                        yield e
                arguments = (call.get("function") or {}).get("arguments")
                if arguments and current is not None and current["kind"] == "function_call":
                    current["text"] += arguments
                    yield event("response.function_call_arguments.delta", item_id=current["id"],
                                output_index=len(output), delta=arguments)
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
