"""OpenAI's Responses API routes: POST /v1/responses over the chat path (the translation is
server/responses_api.py), and GET / DELETE /v1/responses/{id} on the responses kept with `store`
(response_store.py), which a follow-up continues through `previous_response_id`."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.server.chat_runs import finish_chat, start_chat
from tokenmill.server.errors import NotFound
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    assistant_messages,
    output_of,
    response_events,
)
from tokenmill.server.serving import Serving
from tokenmill.server.streaming import event_sse


def add_responses_routes(app: FastAPI, serving: Serving) -> None:
    settings = serving.settings
    responses = ResponseStore(settings.max_stored_responses)  # this app's own, in its memory

    def history_of(req: ResponsesRequest) -> list[dict]:
        """The stored conversation `previous_response_id` continues (none without one); 404 if it is not kept."""
        if req.previous_response_id is None:
            return []
        previous = responses.get(req.previous_response_id)
        if previous is None:
            raise NotFound(f"previous_response_id {req.previous_response_id!r} is not stored here (never made "
                           f"with store: true, deleted, or one of more than --max-stored-responses "
                           f"{settings.max_stored_responses})", param="previous_response_id")
        return previous.messages

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """OpenAI's Responses API (server/responses_api.py); `store` keeps the conversation for a follow-up."""
        arrival = time.monotonic()
        req: ResponsesRequest = await serving.read(request, ResponsesRequest)
        history = history_of(req)
        messages = req.input_messages()
        run = await start_chat(serving, req.to_chat(history, messages), arrival)
        builder = ResponseBuilder(req, run.model)

        def store(body: dict, output: list[dict]) -> None:
            if req.store:
                responses.put(builder.id, StoredResponse(body, history + messages + assistant_messages(output)))

        if req.stream:
            output: list[dict] = []

            async def events():
                async for name, data in response_events(run.writer.chunks(run.stream, run.prompt_tokens), builder,
                                                        output):
                    if name in ("response.completed", "response.incomplete"):
                        store(data["response"], output)
                    yield name, data

            return event_sse(run.stream, events(), lambda body: ("error", {**body["error"], "type": "error"}))
        chat = await finish_chat(request, run)
        if chat is None:
            return Response(status_code=499)
        output, finish_reason = output_of(chat)
        body = builder.body(ResponseBuilder.status(finish_reason), output, ResponseBuilder.usage(chat["usage"]))
        store(body, output)
        return body

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        stored = responses.get(response_id)
        if stored is None:
            raise NotFound(f"no stored response {response_id!r}", param="response_id")
        return stored.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not responses.delete(response_id):
            raise NotFound(f"no stored response {response_id!r}", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}
