"""The load generator's scrape of a server's speculation counters: parsed from Prometheus text, and None (never
an exception) from a server that has no metrics or answers something else."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from tokenmill.bench.spec_metrics import scrape

PROMETHEUS = """# TYPE tokenmill_spec_decode_num_drafts_total counter
tokenmill_spec_decode_num_drafts_total{model_name="m"} 4.0
# TYPE tokenmill_spec_decode_num_draft_tokens_total counter
tokenmill_spec_decode_num_draft_tokens_total{model_name="m"} 12.0
# TYPE tokenmill_spec_decode_num_accepted_tokens_total counter
tokenmill_spec_decode_num_accepted_tokens_total{model_name="m"} 9.0
"""
LLAMA_SERVER_501 = ('{"error":{"code":501,"message":"This server does not support metrics endpoint. Start it with '
                    '`--metrics`","type":"not_supported_error"}}')


def serve(status: int, body: str):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status, body, expected", [
    (200, PROMETHEUS, {"num_drafts": 4.0, "num_draft_tokens": 12.0, "num_accepted_tokens": 9.0}),
    (501, LLAMA_SERVER_501, None),
    (200, LLAMA_SERVER_501, None),  # not Prometheus text
    (200, "# TYPE up gauge\nup 1\n", None),  # metrics, but no speculation
])
def test_scrape(status, body, expected):
    server = serve(status, body)
    try:
        got = scrape(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    if expected is None:
        assert got is None
    else:
        assert {k: got[k] for k in expected} == expected
