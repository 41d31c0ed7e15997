"""uvicorn, adapted: a Server that prints the ready line with the port it really bound and ends requests still
running at the shutdown timeout with a 503, and an HTTP/1.1 protocol that answers malformed requests in JSON."""

from __future__ import annotations

import asyncio
import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import ServerShuttingDown

log = logging.getLogger("tokenmill")


class Server(uvicorn.Server):
    """uvicorn.Server that prints one ready line, with the port it really bound, once it listens, and on
    shutdown ends the requests still running after `drain_timeout` with a 503 (or a stream's error event)
    instead of letting uvicorn cancel them into a plain-text 500 or a cut stream."""

    def __init__(self, config: uvicorn.Config, model_name: str, engine: AsyncEngine, drain_timeout: float):
        super().__init__(config)
        self.model_name, self.engine, self.drain_timeout = model_name, engine, drain_timeout

    async def shutdown(self, sockets=None) -> None:
        stopping = asyncio.ensure_future(super().shutdown(sockets))
        done, _ = await asyncio.wait({stopping}, timeout=self.drain_timeout)
        if not done:
            n = self.engine.fail_all(ServerShuttingDown(
                f"the server is shutting down and could not finish this request within --shutdown-timeout "
                f"{self.drain_timeout:g} s; retry on another replica"))
            if n:
                log.warning("shutdown: %d request(s) still running after %g s were ended with 503", n,
                            self.drain_timeout)
        await stopping

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.config.host, self.config.port
            for srv in self.servers:
                for sock in srv.sockets:
                    port = sock.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            print(f"tokenmill serving {self.model_name} at http://{shown}:{port}", flush=True)


class JSONErrorH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a malformed request (bad Content-Length, a header without a colon
    or with a NUL, HTTP/1.1 without Host) with an OpenAI-style JSON 400 instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": {"message": "malformed HTTP request (request line, headers or Content-Length)",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "malformed_http"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
