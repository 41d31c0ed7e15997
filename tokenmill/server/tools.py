"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the calls in
the prompt and back out of the model's text.

The format is Hermes' (Qwen 2.5, Hermes, SmolLM3 and many fine-tunes write it): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` lines, and a tool's result goes back
between `<tool_response>` tags. A chat template that takes `tools` gets them as they are; one that does not (as
SmolLM2's) gets them described in the system message, in the same format.
- `tool_choice` "auto" (the default with tools): the model chooses; calls found in its text become `tool_calls`
  with `finish_reason: "tool_calls"`, text outside them stays `content`.
- "required" or a named function: the output is constrained (structured output) to calls of the allowed
  functions, arguments following each one's parameter schema; one call, or several with `parallel_tool_calls`.
- "none": the tools are left out of the prompt and nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequest
from tokenmill.structured_params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def call_schema(self) -> dict:
        """The JSON a call of this function is: its name, and arguments following its parameter schema."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolChoice:
    tools: tuple[Tool, ...]
    mode: str  # "auto", "required", "none", or "function" (the one named in `function`)
    function: str | None = None
    parallel: bool = True

    @classmethod
    def parse(cls, tools: Any, tool_choice: Any, parallel: bool) -> ToolChoice | None:
        """The request's tools, checked (400 naming the field); None when it offers none."""
        if not tools and tool_choice is None:  # no tools (an empty list too): plain chat
            return None
        parsed = tuple(_tool(t, i) for i, t in enumerate(tools or []))
        names = [t.name for t in parsed]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise InvalidRequest(f"tools: function {twice!r} is given twice", param="tools")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, str):
            if choice not in ("auto", "required", "none"):
                raise InvalidRequest("tool_choice must be 'auto', 'required', 'none' or {'type': 'function', "
                                     f"'function': {{'name': ...}}}}, got {choice!r}", param="tool_choice")
            if choice != "none" and not parsed:
                raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
            return cls(parsed, choice, parallel=parallel)
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest("tool_choice must be 'auto', 'required', 'none' or {'type': 'function', "
                                 "'function': {'name': ...}}", param="tool_choice")
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return cls(parsed, "function", name, parallel)

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the prompt shows the model."""
        if self.mode == "none":
            return ()
        return tuple(t for t in self.tools if self.mode != "function" or t.name == self.function)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """For "required" or a named function: the output must be calls (Lark, each call's JSON by schema)."""
        if self.mode not in ("required", "function"):
            return None
        schema = {"anyOf": [t.call_schema() for t in self.offered], "x-guidance": {"whitespace_flexible": False}}
        calls = 'call ("\\n" call)*' if self.parallel else "call"
        lark = f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}'
        return StructuredOutputsParams(grammar=lark, param="tools")

    def system_prompt(self) -> str:
        """The tools described for a template that does not take them."""
        listing = "\n".join(json.dumps(t.as_openai()) for t in self.offered)
        one = "one or more functions" if self.parallel else "a function"
        return (f"You may call {one} to assist with the user query. The functions available are:\n<tools>\n"
                f"{listing}\n</tools>\nFor each function call, return a JSON object with the function name and its "
                f"arguments within {OPEN}{CLOSE} tags:\n{OPEN}\n"
                '{"name":<function-name>,"arguments":<args-json-object>}\n' + CLOSE)


def _tool(tool: Any, i: int) -> Tool:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                             param=where)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                             param=f"{where}.function.name")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object",
                             param=f"{where}.function.parameters")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
    return Tool(name, description, params)


# ---- the conversation in ----------------------------------------------------------------------------------------


def template_messages(messages: list[dict], choice: ToolChoice | None, template_takes_tools: bool) -> list[dict]:
    """Messages for a chat template: assistant tool calls written as the model writes them, tool results in
    <tool_response> tags (when the template does not take tools itself), the tools in the system message."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls and not template_takes_tools:
            blocks = [f"{OPEN}\n{_compact({'name': c['function']['name'], 'arguments': _arguments(c)})}\n{CLOSE}"
                      for c in calls]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
        elif calls:
            m["tool_calls"] = calls
        if m["role"] == "tool" and not template_takes_tools:
            m = {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if choice is not None and choice.offered and not template_takes_tools:
        prompt = choice.system_prompt()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _compact(obj: Any) -> str:
    """JSON as the constrained calls are written: no free whitespace."""
    return json.dumps(obj, separators=(",", ":"))


def _arguments(call: dict) -> Any:
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


# ---- the calls out ----------------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, tools: tuple[Tool, ...]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from the model's whole text. A block that is not JSON, or names no offered tool,
    stays in the content: the client sees what the model wrote."""
    names = {t.name for t in tools}
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


def _call(body: str, names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


class CallStream:
    """A streamed choice's text split into content deltas and tool call deltas as OpenAI streams them: content
    flows until a `<tool_call>` opens (text that may be its start is held back); each call goes out when its block
    closes, as a delta with its index, id, type and name, then one with its arguments."""

    def __init__(self, tools: tuple[Tool, ...]):
        self.names = {t.name for t in tools}
        self.buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = _partial_open(self.buffer)
                if len(self.buffer) > keep:
                    out.append({"content": self.buffer[:len(self.buffer) - keep]})
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if start:
                out.append({"content": self.buffer[:start]})
                self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                return out
            block, self.buffer = self.buffer[:end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            call = _call(block[len(OPEN):-len(CLOSE)].strip(), self.names)
            if call is None:
                out.append({"content": block})
                continue
            i, fn = self.num_calls, call["function"]
            self.num_calls += 1
            out.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})

    def finish(self) -> list[dict]:
        """What is still held at the end (an unclosed call stays text)."""
        rest, self.buffer = self.buffer, ""
        return [{"content": rest}] if rest else []


def _partial_open(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
