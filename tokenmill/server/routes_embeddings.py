"""OpenAI's POST /v1/embeddings: each input's final hidden states pooled (--pooling), as floats or base64."""

from __future__ import annotations

import base64
import struct
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.engine.admission import check_token_ids
from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.protocol import EmbeddingRequest
from tokenmill.server.serving import Serving
from tokenmill.server.streaming import collect


def encode_embedding(values: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def add_embedding_routes(app: FastAPI, serving: Serving) -> None:
    engine, settings, info = serving.engine, serving.settings, serving.info

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Each input's final hidden states pooled (--pooling), normalized unless the request says otherwise:
        prefill-only requests batched with the rest, keeping no KV after."""
        arrival = time.monotonic()
        req: EmbeddingRequest = await serving.read(request, EmbeddingRequest)
        model = serving.check_model(req.model)
        if req.dimensions is not None and req.dimensions != info.hidden_size:
            raise InvalidRequest(f"dimensions: {model!r} gives {info.hidden_size}-dimensional embeddings and has no "
                                 "shorter (Matryoshka) form", param="dimensions")
        settings.check_priority(req.priority)
        prompts = await serving.encoder.prompts(req.prompts())
        if req.truncate_prompt_tokens is not None:
            if req.truncate_prompt_tokens < 1:
                raise InvalidRequest("truncate_prompt_tokens must be >= 1", param="truncate_prompt_tokens")
            prompts = [(None, ids[-req.truncate_prompt_tokens:]) for _, ids in prompts]
        for i, (_, ids) in enumerate(prompts):
            check_token_ids(ids, info.vocab_size, f"input.{i}" if len(prompts) > 1 else "input")
        params = SamplingParams(max_tokens=1, pooling=settings.pooling, normalize=req.normalize,
                                priority=req.priority)
        stream = engine.add_requests(f"embd-{uuid.uuid4().hex}", prompts, params, arrival,
                                     lora_request=serving.loras.adapters.get(model))
        if await collect(request, stream, 1) is None:
            return Response(status_code=499)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_embedding(state.embedding, req.encoding_format)}
                for i, state in enumerate(stream.requests)]
        tokens = sum(len(ids) for _, ids in prompts)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
