"""GET /v1/models and GET /v1/models/{id}: the served names (--served-model-name, first is the default) and the
loaded LoRA adapters, each as OpenAI's model card with vLLM's root, parent and max_model_len."""

from __future__ import annotations

from fastapi import FastAPI

from tokenmill.server.serving import Serving


def add_model_routes(app: FastAPI, serving: Serving) -> None:
    settings, names, loras = serving.settings, serving.names, serving.loras

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": settings.created, "owned_by": "tokenmill",
                "root": settings.model_path or name, "parent": None, "max_model_len": serving.info.max_model_len}

    def adapter_card(name: str) -> dict:
        return {**model_card(name), "root": loras.adapters[name].lora_path, "parent": names[0]}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(n) for n in names] + [adapter_card(n) for n in loras.adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        serving.check_model(model_id)
        return adapter_card(model_id) if model_id in loras.adapters else model_card(model_id)
