"""OpenAI's text generation routes: POST /v1/completions (prompts as text or token ids, with vLLM's infill `suffix`)
and POST /v1/chat/completions (the chat path, chat_runs.py). Both stream as server-sent events with `stream: true`;
a client that goes away before a whole answer gets 499 and its request is aborted."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server.chat_runs import finish_chat, start_chat
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.responses import CompletionWriter
from tokenmill.server.serving import Prompts, Serving
from tokenmill.server.streaming import collect, sse


def add_completion_routes(app: FastAPI, serving: Serving) -> None:
    encoder = serving.encoder

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req: CompletionRequest = await serving.read(request, CompletionRequest)

        async def encode(model: str) -> Prompts:
            return await (encoder.infill(req.prompts(), req.suffix, model) if req.suffix else
                          encoder.prompts(req.prompts()))

        started = await serving.start(req, arrival, "cmpl", encode)
        stream, prompts, n = started.stream, started.prompts, started.params.n
        echo = [text if text is not None else serving.tok.decode(ids, skip_special_tokens=False)
                for text, ids in prompts] if req.echo else None
        writer = CompletionWriter(started.request_id, started.model, n, req.logprobs, echo, serving.token_text,
                                  req.prompt_logprobs)
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if req.stream:
            return sse(stream, writer.chunks(stream, usage_prompt if req.include_usage else None))
        choices = await collect(request, stream, n)
        if choices is None:
            return Response(status_code=499)
        return writer.response(choices, usage_prompt, stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req: ChatCompletionRequest = await serving.read(request, ChatCompletionRequest)
        run = await start_chat(serving, req, arrival)
        if req.stream:
            return sse(run.stream, run.writer.chunks(run.stream, run.prompt_tokens if req.include_usage else None))
        body = await finish_chat(request, run)
        return Response(status_code=499) if body is None else body
