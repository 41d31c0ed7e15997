"""EngineProcessClient with a real engine process (a tiny model): start-up errors come back typed, outputs reach the
callback, and a process that dies is reported once."""

from __future__ import annotations

import queue
import time

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.messages import AddRequest, EngineOutputs
from tokenmill.engine.process_client import EngineProcessClient
from tokenmill.errors import ModelLoadError
from tokenmill.sampling_params import SamplingParams


def test_a_start_up_error_comes_back_with_its_type(tmp_path):
    client = EngineProcessClient(EngineConfig(model=str(tmp_path / "missing")))
    client.spawn()
    with pytest.raises(ModelLoadError, match="does not exist"):
        client.wait_ready(timeout=120)
    client.proc.join(10)
    assert not client.alive


def test_outputs_reach_the_callback_and_a_death_is_reported_once(tmp_path):
    path = make_tiny_model(tmp_path, vocab_size=256)
    client = EngineProcessClient(EngineConfig(model=str(path), dtype="float32",
                                              cache=CacheConfig(kv_cache_memory=8 << 20)))
    client.spawn()
    try:
        ready = client.wait_ready(timeout=300)
        assert ready.vocab_size == 256 and ready.pid == client.proc.pid
        got: queue.Queue[EngineOutputs] = queue.Queue()
        exits: queue.Queue[str] = queue.Queue()
        client.run(got.put, exits.put)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        client.send(AddRequest("r", [3, 4, 5], params, 5, frozenset(), time.monotonic()))
        tokens, finish = [], None
        while finish is None:
            msg = got.get(timeout=60)
            for out in msg.outputs:
                tokens += out.new_token_ids
                finish = out.finish_reason or finish
        assert finish == "length" and len(tokens) == 5
        client.proc.kill()
        assert "exited" in exits.get(timeout=30)
        time.sleep(1.5)
        assert exits.empty() and not client.alive
    finally:
        client.shutdown()


def test_a_message_off_its_schema_stops_the_reader_with_the_reason():
    """The step's outputs in it are lost: the client must say so (and the server fail what is in flight) rather
    than read on as if nothing happened."""
    import multiprocessing as mp
    import threading
    from types import SimpleNamespace

    from tokenmill.engine.messages import EngineCoreOutput, encode_output

    client = EngineProcessClient(EngineConfig())
    recv, send = mp.Pipe(duplex=False)
    client._out_recv = recv
    client.proc = SimpleNamespace(is_alive=lambda: True, join=lambda timeout=None: None, exitcode=None)
    got: queue.Queue[EngineOutputs] = queue.Queue()
    exits: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=client._read_loop, args=(got.put, exits.put), daemon=True)
    reader.start()
    send.send_bytes(encode_output(EngineOutputs([EngineCoreOutput("r", [7])])))
    assert got.get(timeout=10).outputs[0].new_token_ids == [7]
    send.send_bytes(b"\x92\xa7unknown\x01")  # a tag no message has
    assert "could not be read" in exits.get(timeout=10)
    reader.join(10)
    assert not reader.is_alive() and got.empty()
