"""KVConnector: how KV leaves a producer and reaches a consumer, behind one interface (shm.py: shared memory on one
host; tcp.py: a socket across hosts).

Producer side (the engine thread calls, a sender thread carries out, in order): `begin` when a request arrives,
`send` after each step with the prompt tokens that step computed (copied out of the block pool at once, so the
blocks are never held for a transfer, and written while the next steps compute), `end` when the prompt is done,
`abort` if the request ends first; `results` hands back each transfer's outcome once the consumer has it all, with
the token (auth.py) that lets a consumer request claim it.
Consumer side: `authorizes(transfer_id, token)` says whether a request may claim that transfer, `claim(transfer_id)`
takes a whole transfer (None if none arrived), the request loads it into its own blocks; what is never claimed is
dropped after `ttl_s`.
KV travels token-major, [tokens, layers, 2 (K, V), kv heads, head dim]: each step's tokens are one contiguous range,
and the two sides need not share a block size.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenmill.disagg.auth import shared_key, token_matches, transfer_token
from tokenmill.disagg.transfer import (
    KVTransferParams,
    KVTransferStats,
    SendResult,
    TransferHeader,
    TransferLayout,
)
from tokenmill.kv_transfer_config import KVTransferConfig

log = logging.getLogger("tokenmill")


@dataclass
class Received:
    """A whole transfer on the consumer: its header and the KV of its tokens, [tokens, layers, 2, heads, dim]."""

    header: TransferHeader
    data: torch.Tensor


@dataclass
class Outgoing:
    """A producer's transfer, as the sender thread tracks it."""

    params: KVTransferParams
    header: TransferHeader
    handle: Any = None  # the connector's: an open file (shm), a socket (tcp)
    first_data: float | None = None
    num_tokens: int = 0
    num_bytes: int = 0
    error: str | None = None


def as_bytes(kv: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(kv.contiguous().view(torch.uint8).numpy()).cast("B")


class KVConnector:
    """The sender thread, the results queue and the counters; subclasses move the bytes."""

    def __init__(self, config: KVTransferConfig, layout: TransferLayout):
        self.config, self.layout = config, layout
        self.key = shared_key(config)
        self._stats = KVTransferStats(role=config.kv_role, connector=config.kv_connector)
        self._stats_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue[SendResult] = queue.SimpleQueue()
        self._outgoing: dict[str, Outgoing] = {}  # sender thread only
        self._sender: threading.Thread | None = None
        if config.produces:
            self._sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
            self._sender.start()

    # ---- producer: called by the engine thread ------------------------------------------------------------
    def begin(self, params: KVTransferParams, token_ids: list[int]) -> None:
        header = TransferHeader(params.transfer_id, self.layout, list(token_ids))
        self._jobs.put(("begin", params.transfer_id, Outgoing(params, header)))

    def send(self, transfer_id: str, start: int, kv: torch.Tensor) -> None:
        """The KV of prompt tokens [start, start + len(kv)), a CPU copy the connector now owns."""
        self._jobs.put(("data", transfer_id, (start, kv, time.monotonic())))

    def end(self, transfer_id: str) -> None:
        self._jobs.put(("end", transfer_id, time.monotonic()))

    def abort(self, transfer_id: str) -> None:
        self._jobs.put(("abort", transfer_id, None))

    def results(self, timeout: float = 0.0) -> list[SendResult]:
        """Transfers that ended since the last call (waiting up to `timeout` for the first)."""
        out = []
        try:
            out.append(self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait())
            while True:
                out.append(self._results.get_nowait())
        except queue.Empty:
            return out

    # ---- consumer ----------------------------------------------------------------------------------------------
    def authorizes(self, transfer_id: str, token: str | None) -> bool:
        """Whether `token` is the one the producer gave for `transfer_id`: only then may a request claim it."""
        return token_matches(self.key, transfer_id, token)

    def claim(self, transfer_id: str) -> Received | None:
        raise NotImplementedError

    def address(self) -> str | None:
        """Where producers ship to (host:port), for connectors that listen."""
        return None

    def close(self) -> None:
        if self._sender is not None:
            self._jobs.put(None)
            self._sender.join(timeout=5)

    def stats(self) -> KVTransferStats:
        """A copy of the counters; the per-transfer send times since the last call move into it."""
        with self._stats_lock:
            copy = replace(self._stats, send_seconds=self._stats.send_seconds)
            self._stats.send_seconds = []
        copy.buffered_bytes = self.buffered_bytes()
        return copy

    def buffered_bytes(self) -> int:
        return 0

    def count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    # ---- the sender thread -------------------------------------------------------------------------------
    def _open(self, out: Outgoing) -> None:
        raise NotImplementedError

    def _write(self, out: Outgoing, start: int, data: memoryview) -> None:
        raise NotImplementedError

    def _finish(self, out: Outgoing) -> None:
        """The last bytes are written: return once the consumer has the whole transfer (raise if it has not)."""
        raise NotImplementedError

    def _discard(self, out: Outgoing) -> None:
        """The transfer failed or was aborted: the consumer must not keep any of it."""

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            op, tid, arg = job
            out = self._outgoing.get(tid)
            try:
                if op == "begin":
                    self._outgoing[tid] = out = arg
                    self._open(out)
                elif out is None:  # aborted already
                    if op == "end":
                        self._results.put(SendResult(tid, False, error="the transfer was never begun",
                                                     token=transfer_token(self.key, tid)))
                    continue
                elif op == "data":
                    start, kv, queued = arg
                    if out.error is None:
                        out.first_data = out.first_data or queued
                        self._write(out, start, as_bytes(kv))
                        out.num_tokens, out.num_bytes = max(out.num_tokens, start + len(kv)), out.num_bytes + kv.nbytes
                elif op == "end":
                    del self._outgoing[tid]
                    if out.error is None:
                        self._finish(out)
                    self._report(out, arg)
                elif op == "abort":
                    del self._outgoing[tid]
                    self._discard(out)
            except Exception as e:  # noqa: BLE001 - a failed transfer fails its request's KV, not the engine
                if out is not None and out.error is None:
                    out.error = f"{type(e).__name__}: {e}"
                    log.warning("KV transfer %s failed: %s", tid, out.error)
                if op == "end" and out is not None:
                    self._report(out, arg)
        for out in self._outgoing.values():
            self._discard(out)

    def _report(self, out: Outgoing, ended: float) -> None:
        now = time.monotonic()
        ok = out.error is None
        if not ok:
            try:
                self._discard(out)
            except Exception as e:  # noqa: BLE001 - best effort: the consumer drops it after ttl_s anyway
                log.debug("discarding KV transfer %s: %s", out.header.transfer_id, e)
        result = SendResult(out.header.transfer_id, ok, out.num_tokens if ok else 0, out.num_bytes if ok else 0,
                            now - (out.first_data or ended), now - ended, out.error,
                            transfer_token(self.key, out.header.transfer_id))
        if ok:
            self.count(sent_transfers=1, sent_tokens=result.num_tokens, sent_bytes=result.num_bytes)
            with self._stats_lock:
                self._stats.send_seconds.append(result.seconds)
        else:
            self.count(failed_sends=1)
        self._results.put(result)

