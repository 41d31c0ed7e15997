"""/admin/backends: the replicas at run time. GET lists them, POST {"url"} adds one, DELETE {"url"} removes one.
Only the operator's --admin-api-key reaches these routes (router/guard.py): a backend added here receives the
clients' prompts and the backend key."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.router.errors import error_response
from tokenmill.router.replicas import ReplicaPool


def add_admin_routes(app: FastAPI, pool: ReplicaPool) -> None:
    @app.get("/admin/backends", response_model=None)
    async def list_backends() -> dict:
        return {"backends": [{"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "load": b.load,
                              "requests": b.requests, "errors": b.errors} for b in list(pool.backends.values())]}

    @app.post("/admin/backends", response_model=None)
    async def add_backend(request: Request) -> dict | JSONResponse:
        url = await backend_url(request)
        if isinstance(url, JSONResponse):
            return url
        pool.add(url)
        return {"added": url}

    @app.delete("/admin/backends", response_model=None)
    async def remove_backend(request: Request) -> dict | JSONResponse:
        url = await backend_url(request)
        if isinstance(url, JSONResponse):
            return url
        if not pool.remove(url):
            return error_response(404, f"no backend {url}", "not_found_error", param="url")
        return {"removed": url}


async def backend_url(request: Request) -> str | JSONResponse:
    """The body's {"url": ...}, normalized; a 400 that says what is wanted otherwise."""
    try:
        url = (await request.json())["url"]
        return ReplicaPool.normalize(url)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return error_response(400, f"the body must be {{\"url\": \"http://host:port\"}}: {e}", param="url")
