"""Anthropic's Messages API routes: POST /v1/messages over the chat path (the translation is server/anthropic.py)
and POST /v1/messages/count_tokens, the prompt's length as the chat template renders it."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server.anthropic import MessagesRequest, message_body, message_events
from tokenmill.server.chat_runs import finish_chat, render_chat, start_chat
from tokenmill.server.errors import anthropic_error
from tokenmill.server.serving import Serving
from tokenmill.server.streaming import event_sse


def add_messages_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API (server/anthropic.py)."""
        arrival = time.monotonic()
        req: MessagesRequest = await serving.read(request, MessagesRequest)
        run = await start_chat(serving, req.to_chat(), arrival)
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            events = message_events(run.writer.chunks(run.stream, run.prompt_tokens), message_id, run.model,
                                    run.prompt_tokens)
            return event_sse(run.stream, events, lambda body: ("error", anthropic_error(body)))
        body = await finish_chat(request, run)
        return Response(status_code=499) if body is None else message_body(body, message_id)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req: MessagesRequest = await serving.read(request, MessagesRequest)
        chat = req.to_chat(for_generation=False)
        serving.check_model(chat.model)
        _, ids = await render_chat(serving, chat)
        return {"input_tokens": len(ids)}
