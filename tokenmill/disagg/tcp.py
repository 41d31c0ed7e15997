"""The TCP connector (across hosts): a consumer listens on `kv_ip:kv_port`; a producer keeps one connection per
consumer and streams each transfer over it as the prompt's steps complete, then waits for the consumer's
acknowledgement that it holds the whole transfer.

A producer connects only to the addresses its requests name, which the edge has checked against `kv_peers`.
Before any KV moves, both ends prove they hold `kv_secret` (auth.py): the consumer sends {"op": "challenge",
"nonce"}, the producer {"op": "hello", "nonce", "mac"}, the consumer {"op": "welcome", "mac"} (or {"op":
"refused", "error"} and closes). A connection that fails this, or takes longer than HANDSHAKE_TIMEOUT_S, is closed
and counted (`rejected_connections`); before it passes, no frame may exceed HANDSHAKE_MAX_FRAME.

Frames: 4 bytes big-endian length, a JSON header {"op": "begin" | "data" | "end" | "abort", "transfer_id", ...};
a "data" frame is followed by its `nbytes` of KV, received straight into the transfer's buffer. The consumer answers
"end" only, with {"ok": bool, "error"?}. A connection that breaks drops its unfinished transfers on the consumer and
fails them on the producer; a consumer refuses (at "end") a transfer its `kv_buffer_size` cannot hold.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill.disagg.auth import handshake_mac, mac_matches, new_nonce
from tokenmill.disagg.connector import KVConnector, Outgoing, Received
from tokenmill.disagg.transfer import TransferHeader, TransferLayout
from tokenmill.kv_transfer_config import KVTransferConfig

log = logging.getLogger("tokenmill")

CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0  # a consumer that stops reading (hung, stopped) fails the transfer after this
MAX_FRAME = 64 << 20  # a header longer than this is not ours
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not proved itself by then is dropped
HANDSHAKE_MAX_FRAME = 4096  # nothing larger is read from a peer that has not proved itself
MAX_HANDSHAKES = 32  # connections in proving at once; more are dropped at once (each holds a thread)


def send_frame(sock: socket.socket, header: dict, payload: memoryview | None = None) -> None:
    body = json.dumps(header).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)
    if payload is not None and len(payload):
        sock.sendall(payload)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the connection closed")
        view = view[n:]


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    head = bytearray(4)
    recv_exact(sock, memoryview(head))
    (length,) = struct.unpack(">I", head)
    if length > limit:
        raise ConnectionError(f"a frame of {length} bytes")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    frame = json.loads(body)
    if not isinstance(frame, dict):
        raise ValueError("a frame that is not a JSON object")
    return frame


def prove_producer(sock: socket.socket, key: bytes) -> None:
    """The producer's half of the handshake: answer the consumer's challenge, then check that it holds the key too
    (KV goes to no listener that does not). ConnectionError if either fails."""
    challenge = recv_frame(sock, HANDSHAKE_MAX_FRAME)
    theirs = challenge.get("nonce")
    if challenge.get("op") != "challenge" or not isinstance(theirs, str):
        raise ConnectionError("not a tokenmill KV consumer (no challenge)")
    ours = new_nonce()
    send_frame(sock, {"op": "hello", "nonce": ours, "mac": handshake_mac(key, "producer", theirs, ours)})
    reply = recv_frame(sock, HANDSHAKE_MAX_FRAME)
    if reply.get("op") == "refused":
        raise ConnectionError(f"the consumer refused this producer: {str(reply.get('error'))[:200]}")
    if reply.get("op") != "welcome" or not mac_matches(reply.get("mac"), handshake_mac(key, "consumer", theirs, ours)):
        raise ConnectionError("the consumer did not prove it holds kv_secret (is it the same on both?)")


def check_producer(sock: socket.socket, key: bytes) -> None:
    """The consumer's half: a fresh challenge the producer must answer with the key, then our own proof.
    ConnectionError (after telling the producer why) if its answer is wrong."""
    ours = new_nonce()
    send_frame(sock, {"op": "challenge", "nonce": ours})
    hello = recv_frame(sock, HANDSHAKE_MAX_FRAME)
    theirs = hello.get("nonce")
    if (hello.get("op") != "hello" or not isinstance(theirs, str) or len(theirs) > 128
            or not mac_matches(hello.get("mac"), handshake_mac(key, "producer", ours, theirs))):
        why = "the producer did not prove it holds kv_secret (is it the same on both?)"
        send_frame(sock, {"op": "refused", "error": why})
        raise ConnectionError(why)
    send_frame(sock, {"op": "welcome", "mac": handshake_mac(key, "consumer", ours, theirs)})


@dataclass
class Incoming:
    header: TransferHeader
    buffer: torch.Tensor  # uint8, the whole transfer's bytes
    filled: int = 0
    done_at: float | None = None  # when the whole transfer arrived (then it is claimable)
    refused: str | None = None


class TcpConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: TransferLayout):
        self._lock = threading.Lock()
        self._incoming: dict[str, Incoming] = {}
        self._buffered = 0
        self._peers: dict[tuple[str, int], socket.socket] = {}  # the sender thread's connections
        self._listener: socket.socket | None = None
        self._accepted: set[socket.socket] = set()  # producers' connections in (closed by `close`)
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        super().__init__(config, layout)
        if config.consumes:
            self._listener = socket.create_server((config.kv_ip, config.kv_port), backlog=64)
            threading.Thread(target=self._accept_loop, name="kv-receiver", daemon=True).start()

    def address(self) -> str | None:
        if self._listener is None:
            return None
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        """Stop sending and receiving: the listener and every connection are shut down (which also wakes the
        threads blocked on them), unfinished incoming transfers dropped."""
        super().close()
        for sock in [self._listener, *self._accepted, *self._peers.values()]:
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (any more)
            sock.close()

    # ---- producer (the sender thread) ----------------------------------------------------------------------
    def _peer(self, out: Outgoing) -> socket.socket:
        key = (out.params.remote_host, out.params.remote_port)
        sock = self._peers.get(key)
        if sock is None:
            sock = socket.create_connection(key, timeout=CONNECT_TIMEOUT_S)
            try:
                prove_producer(sock, self.key)
            except (OSError, ValueError, RecursionError) as e:
                sock.close()
                raise ConnectionError(f"KV consumer {key[0]}:{key[1]}: {e}") from None
            sock.settimeout(IO_TIMEOUT_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._peers[key] = sock
        return sock

    def _on_error(self, out: Outgoing) -> None:
        """The connection is suspect after any error: close it (the consumer drops what it had of it)."""
        sock = self._peers.pop((out.params.remote_host, out.params.remote_port), None)
        if sock is not None:
            sock.close()
        out.handle = None

    def _guarded(self, out: Outgoing, fn) -> None:
        try:
            fn()
        except OSError:
            self._on_error(out)
            raise

    def _open(self, out: Outgoing) -> None:
        def go():
            out.handle = self._peer(out)
            send_frame(out.handle, {"op": "begin", "header": out.header.as_dict()})
        self._guarded(out, go)

    def _write(self, out: Outgoing, start: int, data: memoryview) -> None:
        self._guarded(out, lambda: send_frame(out.handle, {"op": "data", "transfer_id": out.header.transfer_id,
                                                           "start": start, "nbytes": len(data)}, data))

    def _finish(self, out: Outgoing) -> None:
        def go():
            send_frame(out.handle, {"op": "end", "transfer_id": out.header.transfer_id})
            reply = recv_frame(out.handle)
            if not reply.get("ok"):
                raise RuntimeError(f"the consumer refused it: {reply.get('error')}")
        self._guarded(out, go)

    def _discard(self, out: Outgoing) -> None:
        if out.handle is not None:
            try:
                send_frame(out.handle, {"op": "abort", "transfer_id": out.header.transfer_id})
            except OSError:
                self._on_error(out)

    # ---- consumer: the receiver threads ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._handshakes.acquire(blocking=False):
                self._reject(sock, "too many connections proving themselves at once")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), name="kv-receiver-conn", daemon=True).start()

    def _admit(self, sock: socket.socket) -> bool:
        """The producer proves it holds kv_secret before anything else is read from it; else it is dropped."""
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            check_producer(sock, self.key)
        except (OSError, ValueError, RecursionError) as e:
            self._reject(sock, str(e) or type(e).__name__)
            return False
        finally:
            self._handshakes.release()
        sock.settimeout(None)
        return True

    def _reject(self, sock: socket.socket, why: str) -> None:
        self.count(rejected_connections=1)
        try:
            peer = "%s:%s" % sock.getpeername()[:2]
        except OSError:
            peer = "a closed socket"
        log.warning("KV connection from %s refused: %s", peer, why)
        sock.close()

    def _serve(self, sock: socket.socket) -> None:
        conn: set[str] = set()  # transfers begun on this connection, not yet ended
        self._accepted.add(sock)
        try:
            if not self._admit(sock):
                return
            while True:
                frame = recv_frame(sock)
                op = frame.get("op")
                if op == "begin":
                    self._begin(conn, frame["header"])
                elif op == "data":
                    self._data(sock, frame)
                elif op == "end":
                    send_frame(sock, self._end(conn, frame["transfer_id"]))
                elif op == "abort":
                    conn.discard(frame["transfer_id"])
                    self._drop(frame["transfer_id"])
                else:
                    raise ConnectionError(f"unknown op {op!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            if conn:
                log.warning("KV connection from a producer broke (%s): %d transfer(s) dropped", e,
                            len(conn))
        finally:
            self._accepted.discard(sock)
            sock.close()
            for tid in conn:
                self._drop(tid)

    def _begin(self, conn: set[str], raw: dict) -> None:
        self._expire()
        try:
            header = TransferHeader.from_dict(raw)
        except (ValueError, KeyError, TypeError) as e:
            raise ConnectionError(f"a bad transfer header: {e}") from None
        tid = header.transfer_id
        with self._lock:
            self._drop_locked(tid)  # a retried id replaces what was there
            refused = None
            if header.layout != self.layout:
                refused = f"its KV layout {header.layout} is not this engine's {self.layout}"
                buffer = torch.empty(0, dtype=torch.uint8)
            elif self._buffered + header.num_bytes > self.config.kv_buffer_size:
                refused = (f"{header.num_bytes} bytes would exceed kv_buffer_size ({self.config.kv_buffer_size}; "
                           f"{self._buffered} held)")
                buffer = torch.empty(0, dtype=torch.uint8)
            else:
                buffer = torch.empty(header.num_bytes, dtype=torch.uint8)
                self._buffered += header.num_bytes
            self._incoming[tid] = Incoming(header, buffer, refused=refused)
        conn.add(tid)

    def _data(self, sock: socket.socket, frame: dict) -> None:
        tid, start, nbytes = frame["transfer_id"], frame["start"], frame["nbytes"]
        with self._lock:
            inc = self._incoming.get(tid)
        offset = start * self.layout.token_bytes if inc is not None else 0
        if inc is None or inc.refused or offset + nbytes > inc.buffer.numel() or start < 0:
            skip = memoryview(bytearray(min(nbytes, 1 << 20)))  # not ours to keep: read past it, 1 MiB at a time
            while nbytes > 0:
                n = min(nbytes, len(skip))
                recv_exact(sock, skip[:n])
                nbytes -= n
            if inc is not None and not inc.refused:
                inc.refused = f"data past the end ({start}, {nbytes} bytes)"
            return
        recv_exact(sock, memoryview(inc.buffer[offset:offset + nbytes].numpy()))
        inc.filled += nbytes

    def _end(self, conn: set[str], tid: str) -> dict:
        conn.discard(tid)
        with self._lock:
            inc = self._incoming.get(tid)
            error = ("never begun" if inc is None else inc.refused
                     or (None if inc.filled == inc.header.num_bytes
                         else f"{inc.filled} of {inc.header.num_bytes} bytes arrived"))
            if error is None:
                inc.done_at = time.monotonic()
        if error is not None:
            self._drop(tid)
            return {"ok": False, "error": error}
        self.count(received_transfers=1, received_tokens=len(inc.header.token_ids), received_bytes=inc.filled)
        return {"ok": True}

    def _drop(self, tid: str) -> None:
        with self._lock:
            if self._drop_locked(tid):
                self.count(dropped_transfers=1)

    def _drop_locked(self, tid: str) -> bool:
        inc = self._incoming.pop(tid, None)
        if inc is not None:
            self._buffered -= inc.buffer.numel()
        return inc is not None

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, i in self._incoming.items()
                     if i.done_at is not None and now - i.done_at > self.config.ttl_s]
        for tid in stale:
            self._drop(tid)

    # ---- consumer: the engine thread ---------------------------------------------------------------------
    def claim(self, transfer_id: str) -> Received | None:
        self._expire()
        with self._lock:
            inc = self._incoming.get(transfer_id)
            if inc is None or inc.done_at is None:
                return None
            del self._incoming[transfer_id]
            self._buffered -= inc.buffer.numel()
        lay = inc.header.layout
        data = inc.buffer.view(getattr(torch, lay.dtype)).view(len(inc.header.token_ids), lay.num_layers, 2,
                                                                 lay.num_kv_heads, lay.head_dim)
        return Received(inc.header, data)

    def buffered_bytes(self) -> int:
        with self._lock:
            return self._buffered
