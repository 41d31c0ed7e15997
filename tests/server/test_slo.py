"""SLO admission through HTTP: a server with `--slo-admission reject` refuses, with 429 and Retry-After, a request
whose predicted time to first token is past its `slo_ttft_ms`, and admits one whose target is reachable."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow


def test_a_request_predicted_to_miss_its_ttft_target_gets_429_with_retry_after():
    server = start_server("--scheduling-policy", "priority", "--slo-admission", "reject")
    try:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
            for n in (1, 8, 3, 24, 2, 12, 5, 40, 16, 4):  # varied steps: the engine fits its step cost
                body = {"prompt": "word " * (4 * n), "max_tokens": 2, "temperature": 0}
                assert http.post("/v1/completions", json=body).status_code == 200
            long = {"prompt": "word " * 400, "max_tokens": 2, "temperature": 0}
            refused = http.post("/v1/completions", json={**long, "slo_ttft_ms": 0.001})
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            error = refused.json()["error"]
            assert "slo_ttft_ms" in error["message"] and "predicted time to first token" in error["message"]
            assert http.post("/v1/completions", json={**long, "slo_ttft_ms": 60_000}).status_code == 200
            metrics = http.get("/metrics").text
            assert 'tokenmill_requests_rejected_total{model_name=' in metrics
    finally:
        server.stop()
