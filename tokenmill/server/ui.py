"""The web playground and live dashboard `tokenmill serve` serves at / (`--no-ui` turns them off).

One page, every asset in the package (tokenmill/server/static: no CDN, works offline): a chat playground and a raw
completions tab that call the server's own OpenAI API, and a dashboard that polls /ui/stats, the numbers of
/metrics as JSON plus TTFT/ITL percentiles over the last minutes. With --api-key the page asks for the key and
/ui/stats needs it like /v1/*.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

WINDOW_S = 300.0  # the dashboard's latency percentiles cover this many seconds


def _percentiles(samples, since: float) -> dict[str, float | None]:
    values = sorted(v for t, v in list(samples) if t >= since)
    if not values:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    pick = lambda q: round(values[min(len(values) - 1, int(q * len(values)))] * 1e3, 2)
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "count": len(values)}


def stats(engine, metrics, model: str) -> dict:
    """What the dashboard shows, now: the engine's last reported state and the server's counters."""
    s, now = engine.stats, time.monotonic()
    since = now - WINDOW_S
    return {
        "model": model, "time": time.time(), "healthy": engine.healthy,
        "running": s.num_running, "waiting": s.num_waiting, "waiting_tokens": s.num_waiting_tokens,
        "kv_usage": s.kv_usage, "preemptions_total": s.num_preemptions_total,
        "prefix_cache_hit_rate": s.prefix_cache.hit_rate if s.prefix_cache.queries else None,
        "prompt_tokens_total": metrics.prompt_tokens_total,
        "generation_tokens_total": metrics.generation_tokens_total,
        "rejected_total": metrics.rejected_total,
        "ttft_ms": _percentiles(metrics.recent_ttft, since), "itl_ms": _percentiles(metrics.recent_itl, since),
        "window_s": WINDOW_S,
    }


def add_ui_routes(app: FastAPI, engine, metrics, model: str) -> None:
    page = resources.files("tokenmill.server").joinpath("static/index.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page, headers={"Content-Security-Policy": "default-src 'self'; "
                                           "script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'"})

    @app.get("/ui/stats", include_in_schema=False)
    async def ui_stats():
        return JSONResponse(stats(engine, metrics, model))
