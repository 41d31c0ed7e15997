"""One real `tokenmill serve` process per test module, on a free loopback port, with the real default model."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
SERVER_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "256MiB"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    model: str
    stderr_path: Path

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine-core process: the server's child running multiprocessing's spawn entry point."""
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    return int(pid)
        raise AssertionError("no engine process found")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(*extra: str, api_key: str | None = API_KEY, timeout: float = 300.0) -> ServerProcess:
    """Start `tokenmill serve --port 0 ...`, read the URL from its ready line, wait for /health."""
    args = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", *SERVER_FLAGS, *extra]
    if api_key:
        args += ["--api-key", api_key]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TOKENMILL_API_KEY", None)
    err = Path(tempfile.mkstemp(prefix="tokenmill-serve-", suffix=".log")[1])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err.open("w"), env=env, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    while "tokenmill serving" not in line:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start (code {proc.poll()}):\n{err.read_text()}")
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
    # "tokenmill serving MODEL at http://127.0.0.1:PORT"
    model, url = line.split("tokenmill serving ", 1)[1].rsplit(" at ", 1)
    server = ServerProcess(proc, url.strip(), model.strip(), err)
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline and proc.poll() is None, server.stderr()
        time.sleep(0.2)
    return server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "40", "--max-waiting-requests", "48", "--max-request-bytes", "1MiB",
                     "--shutdown-timeout", "60")
    try:
        yield s
    finally:
        s.stop()
