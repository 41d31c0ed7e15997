"""The OpenAI-compatible HTTP API over an AsyncEngine: create_app(engine, settings) and its routes.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (GET, DELETE
/v1/responses/{id}), Anthropic's POST /v1/messages and /v1/messages/count_tokens, GET /health, GET /metrics,
POST /tokenize, POST /detokenize (as vLLM has them), GET /version. What a route needs lives beside it: the guard
(guard.py), prompt encoding (prompts.py), response bodies (responses.py), streaming (streaming.py), errors
(errors.py).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import tokenmill
from tokenmill.disagg.transfer import KVTransferParams
from tokenmill.engine.admission import check_token_ids
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.output_stream import OutputStream
from tokenmill.errors import ConfigError, InvalidRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admin import add_admin_routes
from tokenmill.server.anthropic import MessagesRequest, message_body, message_events
from tokenmill.server.errors import ModelNotFound, NotFound, anthropic_error, error_body, install_error_handlers
from tokenmill.server.guard import Guard
from tokenmill.server.json_body import parse_json, validate
from tokenmill.server.lora_routes import LoRARegistry, add_lora_routes
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.prompts import PromptEncoder
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from tokenmill.server.response_store import ResponseStore, StoredResponse
from tokenmill.server.responses import ChatWriter, CompletionWriter
from tokenmill.server.responses_api import (
    ResponseBuilder,
    ResponsesRequest,
    assistant_messages,
    output_of,
    response_events,
)
from tokenmill.server.settings import ServerSettings
from tokenmill.server.streaming import collect, event_sse, sse
from tokenmill.server.token_text import TokenText
from tokenmill.server.tools import template_messages
from tokenmill.server.ui import add_ui_routes

__all__ = ["ServerSettings", "create_app"]


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


@dataclass
class ChatRun:
    """A queued chat request: the served model's name, its output stream, the writer of its answer."""

    model: str
    stream: OutputStream
    writer: ChatWriter
    prompt_tokens: int
    n: int


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics(settings.model_name)
    if engine.observer is None:
        engine.observer = metrics
    tok = engine.tokenizer
    info = engine.info
    metrics.set_weights(info.weight_format, info.weight_bytes)
    metrics.block_size = info.block_size
    names = list(dict.fromkeys(settings.served_model_names))
    token_text = TokenText(tok)
    encoder = PromptEncoder(tok)
    responses = ResponseStore(settings.max_stored_responses)
    loras = LoRARegistry(engine, names)  # adapters a request may name as its model (lora_routes.py)
    for name, path in settings.lora_modules:
        try:
            loras.add(name, path)
        except InvalidRequest as e:
            raise ConfigError(f"--lora-modules {name}={path}: {e}") from None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics
    app.state.loras = loras
    install_error_handlers(app, metrics.on_rejected)

    async def read(request: Request, model: type) -> Any:
        raw = await request.body()
        return validate(model, parse_json(raw, request.headers.get("content-type")))

    def sampling_params(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        params = req.to_params(info.vocab_size)
        settings.check_priority(params.priority)
        return params

    def check_runner_generates() -> None:  # (a base model's server: the engine refuses text requests itself)
        if settings.runner == "pooling":
            raise InvalidRequest("this server runs --runner pooling: it answers /v1/embeddings, not generation "
                                 "requests", param="model")

    def check_model(name: str | None) -> str:
        if name is None or name in names or name in loras.adapters:
            return name or names[0]
        served = names + list(loras.adapters)
        raise ModelNotFound(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, served))}",
                            param="model")

    if settings.ui:
        add_ui_routes(app, engine, metrics, settings.model_name)
    add_admin_routes(app, engine)
    add_lora_routes(app, loras)

    @app.get("/health")
    async def health():
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body(f"the engine is not running: {engine.dead or 'no recent heartbeat'}",
                                       "service_unavailable", None, "engine_dead"), status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": settings.created, "owned_by": "tokenmill",
                "root": settings.model_path or name, "parent": None, "max_model_len": info.max_model_len}

    @app.get("/v1/kv_transfer")
    async def kv_transfer():
        """This server's part in disaggregated prefill/decode, for the router: its role, its connector and where a
        tcp consumer receives KV (its host as the router reaches it, this port)."""
        cfg = engine.config.kv_transfer
        if cfg is None:
            return {"kv_role": None}
        address = info.kv_transfer_address
        return {"kv_role": cfg.kv_role, "kv_connector": cfg.kv_connector, "kv_address": address,
                "kv_port": int(address.rsplit(":", 1)[1]) if address else None}

    def adapter_card(name: str) -> dict:
        return {**model_card(name), "root": loras.adapters[name].lora_path, "parent": names[0]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names] + [adapter_card(n) for n in loras.adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return adapter_card(model_id) if model_id in loras.adapters else model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req: CompletionRequest = await read(request, CompletionRequest)
        model = check_model(req.model)
        check_runner_generates()
        params = sampling_params(req)
        prompts = await (encoder.infill(req.prompts(), req.suffix, model) if req.suffix else
                         encoder.prompts(req.prompts()))
        grammar = await engine.check_grammar(params)
        transfer = KVTransferParams.from_request(req.kv_transfer_params, engine.config.kv_transfer)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = engine.add_requests(request_id, prompts, params, arrival, req.cache_salt, grammar, transfer,
                                     loras.adapters.get(model))
        echo = [text if text is not None else tok.decode(ids, skip_special_tokens=False) for text, ids in prompts] \
            if req.echo else None
        writer = CompletionWriter(request_id, model, params.n, req.logprobs, echo, token_text, req.prompt_logprobs)
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if req.stream:
            return sse(stream, writer.chunks(stream, usage_prompt if req.include_usage else None))
        choices = await collect(request, stream, params.n)
        if choices is None:
            return Response(status_code=499)
        return writer.response(choices, usage_prompt, stream)

    async def render_chat(req: ChatCompletionRequest) -> tuple[str, list[int]]:
        tools = req.tool_choice_spec()
        takes_tools = tok.template_takes_tools
        messages = template_messages(req.template_messages(), tools, takes_tools)
        return await encoder.render_chat(messages, req.add_generation_prompt,
                                         [t.as_openai() for t in tools.offered] if tools and takes_tools else None,
                                         settings.template_kwargs(req.chat_template_kwargs),
                                         req.continue_final_message)

    async def start_chat(req: ChatCompletionRequest, arrival: float) -> ChatRun:
        """A chat request queued: its stream, the writer of its answer, its prompt's length. The Messages and
        Responses APIs come through here as chat requests."""
        model = check_model(req.model)
        check_runner_generates()
        params = sampling_params(req)
        tools = req.tool_choice_spec()
        text, ids = await render_chat(req)
        grammar = await engine.check_grammar(params)
        transfer = KVTransferParams.from_request(req.kv_transfer_params, engine.config.kv_transfer)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine.add_requests(request_id, [(text, ids)], params, arrival, req.cache_salt, grammar, transfer,
                                     loras.adapters.get(model))
        writer = ChatWriter(request_id, model, params.n, (req.top_logprobs or 0) if req.logprobs else None,
                            token_text, req.prompt_logprobs, tools.offered if tools and tools.parses else None,
                            settings.reasoning_parser, req.echoed())
        return ChatRun(model, stream, writer, len(ids), params.n)

    async def finish_chat(request: Request, run: ChatRun) -> dict | None:
        """The whole answer as a chat completion, or None if the client went away first."""
        choices = await collect(request, run.stream, run.n)
        return None if choices is None else run.writer.response(choices, run.prompt_tokens, run.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req: ChatCompletionRequest = await read(request, ChatCompletionRequest)
        run = await start_chat(req, arrival)
        if req.stream:
            return sse(run.stream, run.writer.chunks(run.stream, run.prompt_tokens if req.include_usage else None))
        body = await finish_chat(request, run)
        return Response(status_code=499) if body is None else body

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API (server/anthropic.py)."""
        arrival = time.monotonic()
        req: MessagesRequest = await read(request, MessagesRequest)
        run = await start_chat(req.to_chat(), arrival)
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            events = message_events(run.writer.chunks(run.stream, run.prompt_tokens), message_id, run.model,
                                    run.prompt_tokens)
            return event_sse(run.stream, events, lambda body: ("error", anthropic_error(body)))
        body = await finish_chat(request, run)
        return Response(status_code=499) if body is None else message_body(body, message_id)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req: MessagesRequest = await read(request, MessagesRequest)
        chat = req.to_chat(for_generation=False)
        check_model(chat.model)
        _, ids = await render_chat(chat)
        return {"input_tokens": len(ids)}

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """OpenAI's Responses API (server/responses_api.py); `store` keeps the conversation for a follow-up."""
        arrival = time.monotonic()
        req: ResponsesRequest = await read(request, ResponsesRequest)
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = responses.get(req.previous_response_id)
            if previous is None:
                raise NotFound(f"previous_response_id {req.previous_response_id!r} is not stored here (never made "
                               f"with store: true, deleted, or one of more than --max-stored-responses "
                               f"{settings.max_stored_responses})", param="previous_response_id")
            history = previous.messages
        messages = req.input_messages()
        run = await start_chat(req.to_chat(history, messages), arrival)
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

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Each input's final hidden states pooled (--pooling), normalized unless the request says otherwise:
        prefill-only requests batched with the rest, keeping no KV after."""
        arrival = time.monotonic()
        req: EmbeddingRequest = await read(request, EmbeddingRequest)
        model = check_model(req.model)
        if req.dimensions is not None and req.dimensions != info.hidden_size:
            raise InvalidRequest(f"dimensions: {model!r} gives {info.hidden_size}-dimensional embeddings and has no "
                                 "shorter (Matryoshka) form", param="dimensions")
        settings.check_priority(req.priority)
        prompts = await encoder.prompts(req.prompts())
        if req.truncate_prompt_tokens is not None:
            if req.truncate_prompt_tokens < 1:
                raise InvalidRequest("truncate_prompt_tokens must be >= 1", param="truncate_prompt_tokens")
            prompts = [(None, ids[-req.truncate_prompt_tokens:]) for _, ids in prompts]
        for i, (_, ids) in enumerate(prompts):
            check_token_ids(ids, info.vocab_size, f"input.{i}" if len(prompts) > 1 else "input")
        params = SamplingParams(max_tokens=1, pooling=settings.pooling, normalize=req.normalize,
                                priority=req.priority)
        stream = engine.add_requests(f"embd-{uuid.uuid4().hex}", prompts, params, arrival,
                                     lora_request=loras.adapters.get(model))
        if await collect(request, stream, 1) is None:
            return Response(status_code=499)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_embedding(state.embedding, req.encoding_format)}
                for i, state in enumerate(stream.requests)]
        tokens = sum(len(ids) for _, ids in prompts)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await read(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either prompt or messages", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text, ids = await encoder.render_chat(chat.template_messages(), req.add_generation_prompt,
                                                  template_kwargs=settings.template_kwargs(req.chat_template_kwargs))
            if req.add_special_tokens:
                ids = await encoder.encode(text, True)
        else:
            ids = await encoder.encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await read(request, DetokenizeRequest)
        check_model(req.model)
        check_token_ids(req.tokens, info.vocab_size, "tokens")
        return {"prompt": await encoder.decode(req.tokens)}

    app.add_middleware(Guard, settings=settings, on_reject=metrics.on_rejected, overloaded=engine.overloaded)
    return app
