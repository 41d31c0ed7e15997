"""vLLM's POST /tokenize (a prompt, or chat messages through the template) and POST /detokenize: the server's own
tokenizer, so a client counts and builds prompts exactly as the engine will see them."""

from __future__ import annotations

from fastapi import FastAPI, Request

from tokenmill.engine.admission import check_token_ids
from tokenmill.errors import InvalidRequest
from tokenmill.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving import Serving


def add_token_routes(app: FastAPI, serving: Serving) -> None:
    encoder, info = serving.encoder, serving.info

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await serving.read(request, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either prompt or messages", param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            text, ids = await encoder.render_chat(
                chat.template_messages(), req.add_generation_prompt,
                template_kwargs=serving.settings.template_kwargs(req.chat_template_kwargs))
            if req.add_special_tokens:
                ids = await encoder.encode(text, True)
        else:
            ids = await encoder.encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids,
                "token_strs": serving.tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await serving.read(request, DetokenizeRequest)
        serving.check_model(req.model)
        check_token_ids(req.tokens, info.vocab_size, "tokens")
        return {"prompt": await encoder.decode(req.tokens)}
