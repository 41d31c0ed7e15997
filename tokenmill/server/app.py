"""The OpenAI-compatible HTTP API over an AsyncEngine: create_app(engine, settings).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics,
POST /tokenize, POST /detokenize (as vLLM has them), GET /version.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.engine.async_engine import AsyncEngine, RequestGroup, SampleDelta
from tokenmill.errors import InvalidRequest, TokenmillError
from tokenmill.server.errors import (
    APIError,
    BadRequest,
    InternalError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    RequestTooLarge,
    Unauthorized,
    classify,
    error_body,
    error_response,
)
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_json,
    validate,
)
from tokenmill.tokenizer import byte_to_unicode

log = logging.getLogger("tokenmill")

# Texts longer than this are tokenized (and chat templates rendered) in a worker thread, off the event loop.
INLINE_TOKENIZE_CHARS = 2048
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = 16 << 20  # as --max-request-bytes' default
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


# ---- ASGI guard: API key and body size, before any parsing ---------------------------------------------------------


GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")


class _Guard:
    """API key, body size and load shedding before any parsing; a JSON 500 for whatever escapes the app."""

    def __init__(self, app, settings: ServerSettings, on_reject: Callable[[int], None],
                 overloaded: Callable[[], Exception | None]):
        self.app, self.settings, self.on_reject, self.overloaded = app, settings, on_reject, overloaded

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        key = self.settings.api_key
        if key and scope["path"].startswith(PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                msg = "missing API key" if not auth else "invalid API key"
                return await self._reject(Unauthorized(f"{msg}: send the header 'Authorization: Bearer <key>'"),
                                          receive, send)
        limit = self.settings.max_request_bytes
        try:
            length = int(headers.get(b"content-length", b"0"))
        except ValueError:
            return await self._reject(BadRequest("invalid Content-Length header"), receive, send)
        if length > limit:
            return await self._reject(_too_large(limit), receive, send)
        if scope["method"] == "POST" and scope["path"] in GENERATE_PATHS:
            full = self.overloaded()  # the queue has no room even for one request: shed it before parsing
            if full is not None:
                return await self._reject(full, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body"):
                        await _drain(receive, limit)
                    raise _too_large(limit)
            return message

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await self._reject(InternalError(f"internal error: {type(exc).__name__}"), receive, send,
                                   drain=False)

    async def _reject(self, exc: Exception, receive, send, drain: bool = True) -> None:
        """Answer without running the app. The body is read and dropped first (up to a bound): a server that
        closes with a request body still arriving makes the client see a reset instead of the answer."""
        status, body = classify(exc)
        self.on_reject(status)
        data = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
        if status in (429, 503):
            headers.append((b"retry-after", b"1"))
        if drain and not await _drain(receive, self.settings.max_request_bytes):
            headers.append((b"connection", b"close"))
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})


async def _drain(receive, limit: int) -> bool:
    """Read and drop the rest of a request body, up to max(4 x limit, 64 MiB); True if it all came."""
    budget = max(4 * limit, 64 << 20)
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return False
        budget -= len(message.get("body", b""))
        if not message.get("more_body"):
            return True
    return False


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"the request body exceeds {limit} bytes (--max-request-bytes)")


# ---- the app -----------------------------------------------------------------------------------------------------


def create_app(engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics(settings.model_name)
    if engine.observer is None:
        engine.observer = metrics
    tok = engine.tokenizer
    info = engine.info
    names = list(dict.fromkeys(settings.served_model_names))
    token_text = _TokenText(tok)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.engine, app.state.settings, app.state.metrics = engine, settings, metrics

    # ---- errors: OpenAI-style bodies, never 422 -----------------------------------------------------------------
    def respond_error(exc: BaseException) -> JSONResponse:
        response = error_response(exc)
        metrics.on_rejected(response.status_code)
        return response

    @app.exception_handler(TokenmillError)
    async def _tokenmill_error(request: Request, exc: TokenmillError):
        return respond_error(exc)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond_error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return respond_error(BadRequest(str(exc.errors()[0].get("msg", "invalid request")) if exc.errors() else
                                        "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return respond_error(NotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            return respond_error(MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}"))
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    # ---- helpers --------------------------------------------------------------------------------------------------
    async def read(request: Request, model):
        raw = await request.body()
        return validate(model, parse_json(raw, request.headers.get("content-type")))

    def check_model(name: str | None) -> str:
        if name is None or name in names:
            return name or names[0]
        raise ModelNotFound(f"the model {name!r} does not exist; this server serves {', '.join(map(repr, names))}",
                            param="model")

    async def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(tok.encode, text, add_special_tokens)
        return tok.encode(text, add_special_tokens)

    async def render_chat(messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[int]]:
        def work():
            try:
                text = tok.render_chat(messages, add_generation_prompt=add_generation_prompt)
            except Exception as e:
                raise InvalidRequest(f"the chat template rejected the messages: {e}", param="messages") from None
            return text, tok.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(work)

    # ---- endpoints -----------------------------------------------------------------------------------------------
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

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req: CompletionRequest = await read(request, CompletionRequest)
        model = check_model(req.model)
        params = req.to_params(info.vocab_size)
        raw = req.prompts()
        texts = [p for p in raw if isinstance(p, str)]
        if sum(map(len, texts)) > INLINE_TOKENIZE_CHARS:
            encoded = iter(await asyncio.to_thread(lambda: [tok.encode(t) for t in texts]))
        else:
            encoded = iter([tok.encode(t) for t in texts])
        prompts = [(p, next(encoded)) if isinstance(p, str) else (None, p) for p in raw]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        group = engine.add_requests(request_id, prompts, params, arrival, req.cache_salt)
        echo = [text if text is not None else tok.decode(ids, skip_special_tokens=False) for text, ids in prompts] \
            if req.echo else None
        writer = _CompletionWriter(request_id, model, params.n, req.logprobs, echo, token_text)
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if req.stream:
            return _sse(group, writer.chunks(group, usage_prompt if req.include_usage else None))
        accs = await _collect(request, group, params.n)
        if accs is None:
            return Response(status_code=499)
        return writer.response(accs, usage_prompt, group)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req: ChatCompletionRequest = await read(request, ChatCompletionRequest)
        model = check_model(req.model)
        params = req.to_params(info.vocab_size)
        text, ids = await render_chat(req.template_messages(), req.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        group = engine.add_requests(request_id, [(text, ids)], params, arrival, req.cache_salt)
        writer = _ChatWriter(request_id, model, params.n, (req.top_logprobs or 0) if req.logprobs else None,
                             token_text)
        if req.stream:
            return _sse(group, writer.chunks(group, len(ids) if req.include_usage else None))
        accs = await _collect(request, group, params.n)
        if accs is None:
            return Response(status_code=499)
        return writer.response(accs, len(ids), group)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await read(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either prompt or messages", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text, ids = await render_chat(chat.template_messages(), req.add_generation_prompt)
            if req.add_special_tokens:
                ids = await encode(text, True)
        else:
            ids = await encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await read(request, DetokenizeRequest)
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", param="tokens")
        if len(req.tokens) > INLINE_TOKENIZE_CHARS:
            text = await asyncio.to_thread(tok.decode, req.tokens, False)
        else:
            text = tok.decode(req.tokens, skip_special_tokens=False)
        return {"prompt": text}

    app.add_middleware(_Guard, settings=settings, on_reject=metrics.on_rejected, overloaded=engine.overloaded)
    return app


# ---- collecting, streaming ---------------------------------------------------------------------------------------


@dataclass
class _Acc:
    """One choice's output so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: SampleDelta) -> None:
        self.text.append(d.text)
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


async def _collect(request: Request, group: RequestGroup, n: int) -> list[_Acc] | None:
    """All choices of a non-streaming request, or None if the client went away first (the request is aborted)."""
    accs = [_Acc() for _ in range(len(group.tracked) * n)]

    async def gather():
        async for update in group:
            for d in update.samples:
                accs[update.prompt_index * n + d.index].add(d)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # raises the request's error, if any
            return accs
        return None
    finally:
        watch.cancel()
        work.cancel()
        group.abort()


class _SSE(StreamingResponse):
    """A streaming response that aborts its requests however it ends: done, client gone, server stopping."""

    def __init__(self, content, group: RequestGroup):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.group = group

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.abort()


def _sse(group: RequestGroup, chunks: AsyncIterator[dict]) -> _SSE:
    async def body():
        try:
            async for chunk in chunks:
                yield b"data: " + _dumps(chunk) + b"\n\n"
        except (TokenmillError, APIError) as e:
            yield b"data: " + _dumps(classify(e)[1]) + b"\n\n"
        except Exception as e:
            log.exception("unexpected error in a stream")
            yield b"data: " + _dumps(classify(e)[1]) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return _SSE(body(), group)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached_tokens(group: RequestGroup) -> int:
    """Prompt tokens served from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens)."""
    return sum(p.num_cached_tokens for p in group.prompts)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class _TokenText:
    """Token id -> its text and its bytes, cached (for logprobs). A token's bytes depend on how its vocabulary
    spells them: byte-level BPE (GPT-2's printable alias per byte), SentencePiece with byte fallback ('<0x0A>' is
    the byte 0x0A, '▁' a space), or else the UTF-8 of its decoded text."""

    _SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tok):
        self.tok = tok
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self._unbyte = {c: b for b, c in byte_to_unicode().items()}
        decoder = json.loads(tok.hf_tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds

    def text(self, tid: int) -> str:
        s = self._text.get(tid)
        if s is None:
            s = self._text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return s

    def bytes(self, tid: int) -> list[int]:
        b = self._bytes.get(tid)
        if b is None:
            piece = self.tok.convert_ids_to_tokens([tid])[0] or ""
            byte = self._SP_BYTE.fullmatch(piece) if self.byte_fallback else None
            if byte:
                b = [int(byte.group(1), 16)]
            elif self.byte_fallback:
                b = list(piece.replace("\u2581", " ").encode("utf-8"))
            elif self.byte_level and piece and all(c in self._unbyte for c in piece):
                b = [self._unbyte[c] for c in piece]
            else:
                b = list(self.text(tid).encode("utf-8"))
            self._bytes[tid] = b
        return b


class _StreamWriter:
    """What completion and chat responses share: the chunk envelope and the closing usage chunk."""

    chunk_object = ""

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}

    def _usage_chunk(self, prompt_tokens: int, completion_tokens: int, group: RequestGroup) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = _usage(prompt_tokens, completion_tokens, _cached_tokens(group))
        return chunk


class _CompletionWriter(_StreamWriter):
    chunk_object = "text_completion"

    def __init__(self, request_id: str, model: str, n: int, logprobs: int | None, echo: list[str] | None,
                 token_text: _TokenText):
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

    def response(self, accs: list[_Acc], prompt_tokens: int, group: RequestGroup) -> dict:
        choices = []
        for i, a in enumerate(accs):
            text = "".join(a.text)
            if self.echo:
                text = self.echo[i // self.n] + text
            choices.append(self._choice(i, text, a.token_ids, a.logprobs, a.finish_reason, a.stop_reason))
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices,
                "usage": _usage(prompt_tokens, sum(len(a.token_ids) for a in accs), _cached_tokens(group))}

    async def chunks(self, group: RequestGroup, usage_prompt: int | None) -> AsyncIterator[dict]:
        completion_tokens = 0
        echoed: set[int] = set()
        if self.echo:
            for i in range(len(group.tracked) * self.n):
                echoed.add(i)
                yield self._chunk([self._choice(i, self.echo[i // self.n], [], [], None, None)])
        async for update in group:
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
            yield self._usage_chunk(usage_prompt, completion_tokens, group)


class _ChatWriter(_StreamWriter):
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, n: int, top_logprobs: int | None, token_text: _TokenText):
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

    def response(self, accs: list[_Acc], prompt_tokens: int, group: RequestGroup) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": "".join(a.text)},
                    "logprobs": self._logprobs(a.token_ids, a.logprobs) if self.top is not None else None,
                    "finish_reason": a.finish_reason, "stop_reason": a.stop_reason}
                   for i, a in enumerate(accs)]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices,
                "usage": _usage(prompt_tokens, sum(len(a.token_ids) for a in accs), _cached_tokens(group))}

    async def chunks(self, group: RequestGroup, usage_prompt: int | None) -> AsyncIterator[dict]:
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.n)])
        completion_tokens = 0
        async for update in group:
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
            yield self._usage_chunk(usage_prompt, completion_tokens, group)
