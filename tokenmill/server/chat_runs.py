"""The chat path: a ChatCompletionRequest templated, queued and answered. /v1/chat/completions runs on it, and the
Messages and Responses APIs (routes_messages.py, routes_responses.py) turn their requests into chat requests and come
through here, so all three are validated, templated, constrained and parsed alike."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from tokenmill.engine.output_stream import OutputStream
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.responses import ChatWriter
from tokenmill.server.serving import Serving
from tokenmill.server.streaming import collect
from tokenmill.server.tools import template_messages


@dataclass
class ChatRun:
    """A queued chat request: the served model's name, its output stream, the writer of its answer."""

    model: str
    stream: OutputStream
    writer: ChatWriter
    prompt_tokens: int
    n: int


async def render_chat(serving: Serving, req: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The request's messages (and tools, when the template takes them) through the chat template."""
    tools = req.tool_choice_spec()
    takes_tools = serving.tok.template_takes_tools
    messages = template_messages(req.template_messages(), tools, takes_tools)
    return await serving.encoder.render_chat(messages, req.add_generation_prompt,
                                             [t.as_openai() for t in tools.offered] if tools and takes_tools else None,
                                             serving.settings.template_kwargs(req.chat_template_kwargs),
                                             req.continue_final_message)


async def start_chat(serving: Serving, req: ChatCompletionRequest, arrival: float) -> ChatRun:
    """A chat request queued: its stream, the writer of its answer, its prompt's length."""

    async def encode(model: str) -> list[tuple[str, list[int]]]:
        return [await render_chat(serving, req)]

    started = await serving.start(req, arrival, "chatcmpl", encode)
    tools = req.tool_choice_spec()  # (already parsed without error by the params and the template: no new failure)
    writer = ChatWriter(started.request_id, started.model, started.params.n,
                        (req.top_logprobs or 0) if req.logprobs else None, serving.token_text, req.prompt_logprobs,
                        tools.offered if tools and tools.parses else None, serving.settings.reasoning_parser,
                        req.echoed())
    _, ids = started.prompts[0]
    return ChatRun(started.model, started.stream, writer, len(ids), started.params.n)


async def finish_chat(request: Request, run: ChatRun) -> dict | None:
    """The whole answer as a chat completion, or None if the client went away first."""
    choices = await collect(request, run.stream, run.n)
    return None if choices is None else run.writer.response(choices, run.prompt_tokens, run.stream)
