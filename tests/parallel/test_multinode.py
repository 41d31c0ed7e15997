"""Several hosts, tried on loopback: node 0 runs `tokenmill serve --nnodes 2 --node-rank 0 --master-addr A
--master-port P` with its ranks, node 1 `tokenmill worker` with the same flags and --node-rank 1; the answers are
one process's, and a node that dies takes the server down with an error, not a hang."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.parallel.test_tp_serving import flags, model  # noqa: F401 - the module's tiny-model fixture
from tests.server.conftest import start_server
from tokenmill.cli import main

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_refuses_to_be_node_zero(capsys):
    assert main(["worker", "--tensor-parallel-size", "2"]) == 2
    assert "--node-rank K (K >= 1)" in capsys.readouterr().err


def test_two_nodes_answer_as_one_process_and_a_dead_node_stops_the_server(model):  # noqa: F811
    port = free_port()
    nodes = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    node1 = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "worker", *flags(model), *nodes,
                              "--node-rank", "1"], env=env, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert "ranks 2-3 of 4" in node1.stdout.readline()
        served = start_server(*flags(model), *nodes, "--node-rank", "0", api_key=None)
        one = start_server(*flags(model), api_key=None)
        try:
            body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            got = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
            assert got["choices"] == httpx.post(one.url + "/v1/completions", json=body, timeout=60).json()["choices"]
            os.killpg(node1.pid, signal.SIGKILL)  # node 1 and its ranks
            node1.wait(10)
            r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code >= 500
            assert served.proc.wait(60) != 0
        finally:
            served.stop()
            one.stop()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_under_torchrun_rank_zero_serves_and_the_others_work(model):  # noqa: F811
    """`torchrun --nproc-per-node 2 -m tokenmill.cli serve --tensor-parallel-size 2`: torchrun starts both ranks,
    rank 0 serves (meeting rank 1 where torchrun says), and the answers are one process's."""
    import select
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "-m", "tokenmill.cli", "serve", *flags(model), "--tensor-parallel-size", "2",
                            "--port", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           start_new_session=True)
    one = start_server(*flags(model), api_key=None)
    try:
        line, deadline = "", time.monotonic() + 300
        while "tokenmill serving" not in line:
            assert run.poll() is None and time.monotonic() < deadline, "torchrun did not serve"
            if select.select([run.stdout], [], [], 1.0)[0]:
                line = run.stdout.readline()
        url = line.rsplit(" at ", 1)[1].strip()
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.2)
        body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"] == httpx.post(one.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    finally:
        one.stop()
        os.killpg(run.pid, signal.SIGTERM)
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
