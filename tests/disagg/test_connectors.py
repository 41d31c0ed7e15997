"""The KV connectors on their own: a producer's connector ships token ranges in any number of pieces, the consumer's
gets the whole transfer or nothing; refusals, aborts and a side that dies end every transfer without a hang or a
buffer left behind. Both tcp ends prove they hold kv_secret before KV moves; a shm directory others may write is
refused; the edge checks destinations against kv_peers and claims against the producer's transfer_token."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from tokenmill.disagg import make_connector
from tokenmill.disagg.auth import handshake_mac, transfer_token
from tokenmill.disagg.connector import KVConnector
from tokenmill.disagg.tcp import prove_producer, recv_frame, send_frame
from tokenmill.disagg.transfer import KVTransferParams, TransferHeader, TransferLayout
from tokenmill.errors import ConfigError, InvalidRequest
from tokenmill.kv_transfer_config import KVTransferConfig

LAYOUT = TransferLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", itemsize=2)
SECRET = "connector-test-secret-0123456789"


def kv(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 3, 2, 2, 8, generator=g).to(torch.bfloat16)


def connectors(tmp_path, name: str, layout: TransferLayout = LAYOUT, producer_secret: str = SECRET,
               **extra) -> tuple[KVConnector, KVConnector]:
    common = {"kv_connector": name, "shm_dir": str(tmp_path / "shm"), "kv_port": 0}
    consumer = make_connector(KVTransferConfig(kv_role="kv_consumer", kv_secret=SECRET, **common, **extra), layout)
    producer = make_connector(KVTransferConfig(kv_role="kv_producer", kv_secret=producer_secret, **common), LAYOUT)
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
        assert result.as_params(16)["transfer_token"] == transfer_token(SECRET.encode(), "t1")
        assert consumer.authorizes("t1", result.token) and not consumer.authorizes("t2", result.token)
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
    other = TransferLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", itemsize=4)
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
        host, port = consumer.address().rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        prove_producer(sock, SECRET.encode())
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
    producer = KVTransferConfig(kv_connector="tcp", kv_role="kv_producer", kv_secret=SECRET, kv_peers=["h:9"])
    consumer = KVTransferConfig(kv_connector="tcp", kv_role="kv_consumer", kv_secret=SECRET)
    ship = {"do_remote_decode": True, "transfer_id": "a-1"}
    assert KVTransferParams.from_request({**ship, "remote_host": "h", "remote_port": 9}, producer) == \
        KVTransferParams("a-1", True, "h", 9)
    assert KVTransferParams.from_request({**ship, "remote_host": "H", "remote_port": 9}, producer).remote_host == "H"
    token = transfer_token(SECRET.encode(), "a-1")
    take = {"do_remote_prefill": True, "transfer_id": "a-1"}
    assert KVTransferParams.from_request({**take, "transfer_token": token}, consumer) == \
        KVTransferParams("a-1", False, transfer_token=token)
    foreign = transfer_token(b"some-other-secret-0123456789", "a-1")
    bad = [({"do_remote_decode": True, "transfer_id": "../etc"}, producer, "transfer_id"),
           ({"do_remote_decode": True, "transfer_id": "x"}, producer, "remote_host"),
           ({**ship, "remote_host": "h", "remote_port": True}, producer, "remote_host"),
           ({**ship, "remote_host": "169.254.169.254", "remote_port": 80}, producer, "not one of this producer's"),
           ({**ship, "remote_host": "h", "remote_port": 10}, producer, "kv_peers"),
           ({**ship, "remote_host": "h/x", "remote_port": 9}, producer, "host name or an IP address"),
           ({"transfer_id": "x"}, producer, "exactly one"),
           ({"do_remote_prefill": True, "transfer_id": "x"}, producer, "not a consumer"),
           ({"do_remote_decode": True, "transfer_id": "x"}, None, "--kv-transfer-config"),
           (take, consumer, "transfer_token is required"),
           ({**take, "transfer_token": 7}, consumer, "transfer_token is required"),
           ({**take, "transfer_id": "a-2", "transfer_token": token}, consumer, "not the producer's token"),
           ({**take, "transfer_token": foreign}, consumer, "not the producer's token"),
           ("x", producer, "an object")]
    for value, config, message in bad:
        with pytest.raises(InvalidRequest, match=message) as e:
            KVTransferParams.from_request(value, config)
        assert e.value.param == "kv_transfer_params"


def test_the_config_names_its_peers_and_tcp_requires_a_secret(monkeypatch):
    monkeypatch.delenv("TOKENMILL_KV_SECRET", raising=False)
    cfg = KVTransferConfig.parse({"kv_role": "kv_producer", "kv_secret": SECRET,
                                  "kv_peers": ["Decode-1:14579", "[::1]:80", "decode-1:14579"]})
    assert cfg.kv_peers == ["decode-1:14579", "[::1]:80"] and SECRET not in repr(cfg)
    assert KVTransferConfig(kv_connector="shm").kv_secret is None  # shm: a key file in shm_dir instead
    for kw, message in (({}, "tcp connector needs kv_secret"), ({"kv_secret": "short"}, "at least 16"),
                        ({"kv_secret": SECRET, "kv_peers": "h:1"}, "a list"),
                        ({"kv_secret": SECRET, "kv_peers": ["h"]}, "host:port"),
                        ({"kv_secret": SECRET, "kv_peers": ["h:0"]}, "port 1-65535"),
                        ({"kv_secret": SECRET, "kv_peers": ["http://h:1"]}, "host:port")):
        with pytest.raises(ConfigError, match=message):
            KVTransferConfig(kv_connector="tcp", **kw)
    monkeypatch.setenv("TOKENMILL_KV_SECRET", SECRET)  # kept out of the command line (ps shows it)
    assert KVTransferConfig(kv_connector="tcp").kv_secret == SECRET


def old_protocol(sock: socket.socket) -> None:
    """A producer without the secret, speaking as one did before the handshake: a transfer straight away."""
    send_frame(sock, {"op": "begin", "header": TransferHeader("t9", LAYOUT, list(range(10))).as_dict()})


def wrong_mac(sock: socket.socket) -> None:
    nonce = recv_frame(sock)["nonce"]
    send_frame(sock, {"op": "hello", "nonce": "ab" * 16,
                      "mac": handshake_mac(b"not-the-secret-0123456789", "producer", nonce, "ab" * 16)})


def closed_by_peer(sock: socket.socket) -> bool:
    """Read to the end of the stream: True once the other side has closed it."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_tcp_connection_that_does_not_prove_the_secret_is_dropped_and_counted(tmp_path):
    producer, consumer = connectors(tmp_path, "tcp")
    producer.close()
    host, port = consumer.address().rsplit(":", 1)
    try:
        # a legit hello, replayed on a second connection (its challenge is fresh): refused too
        legit = socket.create_connection((host, int(port)), timeout=10)
        nonce = recv_frame(legit)["nonce"]
        hello = {"op": "hello", "nonce": "cd" * 16, "mac": handshake_mac(SECRET.encode(), "producer", nonce, "cd" * 16)}
        send_frame(legit, hello)
        assert recv_frame(legit)["op"] == "welcome"

        def replay(sock: socket.socket) -> None:
            recv_frame(sock)
            send_frame(sock, hello)
        for n, attempt in enumerate((old_protocol, wrong_mac, replay, lambda sock: None), 1):
            sock = socket.create_connection((host, int(port)), timeout=10)
            attempt(sock)  # the last says nothing: dropped after HANDSHAKE_TIMEOUT_S
            assert closed_by_peer(sock)
            sock.close()
            assert consumer.stats().rejected_connections == n
        assert consumer.stats().buffered_bytes == 0 and consumer.claim("t9") is None
        legit.close()
    finally:
        consumer.close()


def test_tcp_ends_with_different_secrets_move_no_kv(tmp_path):
    producer, consumer = connectors(tmp_path, "tcp", producer_secret="another-secret-0123456789")
    try:
        producer.begin(target(consumer, "t10"), list(range(8)))
        producer.send("t10", 0, kv(8))
        producer.end("t10")
        result = wait_result(producer)
        assert not result.ok and "kv_secret" in result.error
        deadline = time.monotonic() + 10  # the refusal reaches the producer before the consumer's thread counts it
        while consumer.stats().rejected_connections == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.stats().rejected_connections == 1 and consumer.stats().buffered_bytes == 0
        assert consumer.claim("t10") is None
    finally:
        producer.close()
        consumer.close()


def test_a_producer_sends_no_kv_to_a_listener_that_does_not_prove_the_secret(tmp_path):
    """A listener at a consumer's address that answers the handshake without the key gets not one KV byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    got = bytearray()

    def impostor() -> None:
        sock, _ = listener.accept()
        sock.settimeout(10)
        send_frame(sock, {"op": "challenge", "nonce": "ef" * 16})
        recv_frame(sock)  # the producer's hello
        send_frame(sock, {"op": "welcome", "mac": "00" * 32})
        while chunk := sock.recv(1 << 16):
            got.extend(chunk)
        sock.close()
    thread = threading.Thread(target=impostor)
    thread.start()
    producer = make_connector(KVTransferConfig(kv_role="kv_producer", kv_secret=SECRET, kv_port=0), LAYOUT)
    try:
        producer.begin(KVTransferParams("t11", True, "127.0.0.1", listener.getsockname()[1]), list(range(8)))
        producer.send("t11", 0, kv(8))
        producer.end("t11")
        result = wait_result(producer)
        assert not result.ok and "did not prove it holds kv_secret" in result.error
        thread.join(10)
        assert got == b""
    finally:
        producer.close()
        listener.close()


def test_shm_needs_a_directory_only_this_user_may_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by no one else"):
        make_connector(KVTransferConfig(kv_connector="shm", kv_role="kv_consumer", shm_dir=str(shared)), LAYOUT)
    assert not list(shared.iterdir())


def test_shm_without_a_secret_shares_a_key_file_in_its_directory(tmp_path):
    common = {"kv_connector": "shm", "shm_dir": str(tmp_path / "shm")}
    producer = make_connector(KVTransferConfig(kv_role="kv_producer", **common), LAYOUT)
    consumer = make_connector(KVTransferConfig(kv_role="kv_consumer", **common), LAYOUT)
    elsewhere = make_connector(KVTransferConfig(kv_role="kv_consumer", kv_connector="shm",
                                                shm_dir=str(tmp_path / "other")), LAYOUT)
    try:
        producer.begin(KVTransferParams("t12", True), [1, 2])
        producer.send("t12", 0, kv(2))
        producer.end("t12")
        result = wait_result(producer)
        assert result.ok and consumer.authorizes("t12", result.token)
        assert not elsewhere.authorizes("t12", result.token)
        assert (tmp_path / "shm" / ".kv_secret").stat().st_mode & 0o077 == 0
        assert consumer.claim("t12") is not None
    finally:
        for c in (producer, consumer, elsewhere):
            c.close()
