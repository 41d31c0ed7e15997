"""The KV connectors on their own: a producer's connector ships token ranges in any number of pieces, the consumer's
gets the whole transfer or nothing; refusals, aborts and a side that dies end every transfer without a hang or a
buffer left behind."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from tokenmill.config import KVTransferConfig
from tokenmill.disagg import make_connector
from tokenmill.disagg.connector import KVConnector
from tokenmill.disagg.transfer import KVLayout, KVTransferParams
from tokenmill.errors import InvalidRequest

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", itemsize=2)


def kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, 2, 2, 8, generator=g).to(torch.bfloat16)


def connectors(tmp_path, name: str, layout: KVLayout = LAYOUT, **extra) -> tuple[KVConnector, KVConnector]:
    common = {"kv_connector": name, "shm_dir": str(tmp_path / "shm"), "kv_port": 0}
    producer = make_connector(KVTransferConfig(kv_role="kv_producer", **common), LAYOUT)
    consumer = make_connector(KVTransferConfig(kv_role="kv_consumer", **common, **extra), layout)
    return producer, consumer


def target(consumer: KVConnector, tid: str) -> KVTransferParams:
    address = consumer.address()
    host, port = address.rsplit(":", 1) if address else (None, None)
    return KVTransferParams(tid, True, host, int(port) if port else None)


def wait_result(producer: KVConnector, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = producer.results(0.05)
        if got:
            assert len(got) == 1
            return got[0]
    raise AssertionError("no result: the transfer hangs")


@pytest.fixture(params=["shm", "tcp"])
def name(request):
    return request.param


def test_pieces_arrive_whole_and_a_transfer_is_claimed_once(tmp_path, name):
    producer, consumer = connectors(tmp_path, name)
    try:
        data, prompt = kv(50), list(range(50))
        producer.begin(target(consumer, "t1"), prompt)
        for start, end in ((0, 16), (16, 32), (32, 48), (48, 50)):
            producer.send("t1", start, data[start:end].clone())
        producer.end("t1")
        result = wait_result(producer)
        assert result.ok and result.num_tokens == 50 and result.num_bytes == data.numel() * 2
        got = consumer.claim("t1")
        assert got.header.token_ids == prompt and torch.equal(got.data, data)
        assert consumer.claim("t1") is None
        stats = consumer.stats()
        assert (stats.received_transfers, stats.received_tokens, stats.buffered_bytes) == (1, 50, 0)
        assert producer.stats().sent_bytes == data.numel() * 2
    finally:
        producer.close()
        consumer.close()


def test_an_aborted_transfer_leaves_nothing_on_the_consumer(tmp_path, name):
    producer, consumer = connectors(tmp_path, name)
    try:
        producer.begin(target(consumer, "t2"), list(range(40)))
        producer.send("t2", 0, kv(16))
        producer.abort("t2")
        producer.begin(target(consumer, "t3"), [1, 2])  # the next transfer on the same connection still works
        producer.send("t3", 0, kv(2))
        producer.end("t3")
        assert wait_result(producer).ok
        assert consumer.claim("t2") is None and consumer.claim("t3") is not None
        assert consumer.stats().buffered_bytes == 0
        if name == "shm":
            assert not list((tmp_path / "shm").iterdir())
    finally:
        producer.close()
        consumer.close()


def test_a_layout_the_consumer_does_not_share_is_refused(tmp_path, name):
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", itemsize=4)
    producer, consumer = connectors(tmp_path, name, layout=other)
    try:
        producer.begin(target(consumer, "t4"), list(range(4)))
        producer.send("t4", 0, kv(4))
        producer.end("t4")
        result = wait_result(producer)
        if name == "tcp":  # refused as it arrives
            assert not result.ok and "layout" in result.error
            assert consumer.claim("t4") is None
        else:  # shm: refused when claimed
            assert result.ok
            with pytest.raises(ValueError, match="layout"):
                consumer.claim("t4")
    finally:
        producer.close()
        consumer.close()


def test_a_transfer_larger_than_the_consumers_buffer_fails_at_the_producer(tmp_path):
    producer, consumer = connectors(tmp_path, "tcp", kv_buffer_size=1 << 20)
    try:
        tokens = (1 << 20) // LAYOUT.token_bytes + 1
        producer.begin(target(consumer, "big"), list(range(tokens)))
        producer.send("big", 0, kv(tokens))
        producer.end("big")
        result = wait_result(producer)
        assert not result.ok and "kv_buffer_size" in result.error
        assert consumer.stats().buffered_bytes == 0 and producer.stats().failed_sends == 1
    finally:
        producer.close()
        consumer.close()


def test_a_consumer_that_is_gone_fails_the_transfer_promptly(tmp_path):
    producer, consumer = connectors(tmp_path, "tcp")
    params = target(consumer, "t5")
    consumer.close()  # nothing listens there any more
    try:
        producer.begin(params, list(range(8)))
        producer.send("t5", 0, kv(8))
        producer.end("t5")
        result = wait_result(producer)
        assert not result.ok and result.error
    finally:
        producer.close()


def test_a_consumer_that_dies_mid_transfer_fails_it_and_the_next_one_reconnects(tmp_path):
    producer, consumer = connectors(tmp_path, "tcp")
    try:
        params = target(consumer, "t6")
        producer.begin(params, list(range(64)))
        producer.send("t6", 0, kv(32))
        time.sleep(0.2)
        for sock in list(producer._peers.values()):  # the consumer's end of the connection goes away
            sock.shutdown(socket.SHUT_RDWR)
        producer.send("t6", 32, kv(32))
        producer.end("t6")
        assert not wait_result(producer).ok
        producer.begin(target(consumer, "t7"), [5])
        producer.send("t7", 0, kv(1))
        producer.end("t7")
        assert wait_result(producer).ok
        deadline = time.monotonic() + 5
        while consumer.stats().buffered_bytes != LAYOUT.token_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.stats().buffered_bytes == LAYOUT.token_bytes  # t6's partial buffer was dropped
    finally:
        producer.close()
        consumer.close()


def test_a_producer_that_dies_mid_transfer_leaves_no_buffer_behind(tmp_path):
    _, consumer = connectors(tmp_path, "tcp")
    try:
        from tokenmill.disagg.tcp import send_frame
        from tokenmill.disagg.transfer import TransferHeader

        host, port = consumer.address().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        send_frame(sock, {"op": "begin", "header": TransferHeader("t8", LAYOUT, list(range(10))).as_dict()})
        time.sleep(0.2)
        assert consumer.stats().buffered_bytes == 10 * LAYOUT.token_bytes
        sock.close()  # the producer died
        deadline = time.monotonic() + 5
        while consumer.stats().buffered_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.stats().buffered_bytes == 0 and consumer.claim("t8") is None
        assert consumer.stats().dropped_transfers == 1
    finally:
        consumer.close()


def test_shm_files_no_one_claims_are_removed_after_the_ttl(tmp_path):
    producer, consumer = connectors(tmp_path, "shm", ttl_s=1)
    try:
        producer.begin(target(consumer, "old"), [1, 2])
        producer.send("old", 0, kv(2))
        producer.end("old")
        assert wait_result(producer).ok
        path = tmp_path / "shm" / "old.kv"
        os.utime(path, (time.time() - 10, time.time() - 10))
        consumer._last_sweep = 0.0
        assert consumer.claim("old") is None and not path.exists()
        assert consumer.stats().dropped_transfers == 1
    finally:
        producer.close()
        consumer.close()


def test_request_params_are_checked_at_the_edge():
    producer = KVTransferConfig(kv_connector="tcp", kv_role="kv_producer")
    ok = KVTransferParams.from_request({"do_remote_decode": True, "transfer_id": "a-1", "remote_host": "h",
                                        "remote_port": 9}, producer)
    assert ok == KVTransferParams("a-1", True, "h", 9)
    bad = [({"do_remote_decode": True, "transfer_id": "../etc"}, producer, "transfer_id"),
           ({"do_remote_decode": True, "transfer_id": "x"}, producer, "remote_host"),
           ({"transfer_id": "x"}, producer, "exactly one"),
           ({"do_remote_prefill": True, "transfer_id": "x"}, producer, "not a consumer"),
           ({"do_remote_decode": True, "transfer_id": "x"}, None, "--kv-transfer-config"),
           ("x", producer, "an object")]
    for value, config, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            KVTransferParams.from_request(value, config)
