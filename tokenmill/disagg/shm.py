"""The shared-memory connector (one host): a producer writes each transfer into a file under `shm_dir` (a tmpfs, so
memory, not disk) as its prompt's steps complete, and renames it into place when whole; a consumer maps the file
and copies the KV straight into its own blocks. The rename is the acknowledgement: a consumer never sees part of a
transfer. Files no one claims (the router died between the two halves; a consumer never came) and the partial
files of a producer that died are removed after `ttl_s` by whichever side looks next.

`shm_dir` must be this user's and writable by no one else (checked at start-up, auth.py): then only this user's
processes can put a transfer there, so the files need no MAC. A consumer request still needs the transfer's token to
claim it (the key: `kv_secret`, or without one a random key file in `shm_dir`).

File: 8 bytes little-endian header length, the header (JSON), zero padding to 64 bytes, then the KV token-major.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tokenmill.disagg.auth import private_dir
from tokenmill.disagg.connector import KVConnector, Outgoing, Received
from tokenmill.disagg.transfer import TransferHeader, TransferLayout
from tokenmill.kv_transfer_config import KVTransferConfig

ALIGN = 64
SWEEP_EVERY_S = 5.0


def data_offset(header_bytes: int) -> int:
    return -(-(8 + header_bytes) // ALIGN) * ALIGN


class SharedMemoryConnector(KVConnector):
    def __init__(self, config: KVTransferConfig, layout: TransferLayout):
        self.dir = private_dir(Path(config.shm_dir))
        self._last_sweep = 0.0
        self._sweep_lock = threading.Lock()
        super().__init__(config, layout)

    def _path(self, transfer_id: str, whole: bool) -> Path:
        return self.dir / f"{transfer_id}.{'kv' if whole else 'part'}"

    # ---- producer (the sender thread) ----------------------------------------------------------------------
    def _open(self, out: Outgoing) -> None:
        self._sweep()
        header = json.dumps(out.header.as_dict()).encode()
        offset = data_offset(len(header))
        fd = os.open(self._path(out.header.transfer_id, False), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        out.handle = (fd, offset)
        os.pwrite(fd, len(header).to_bytes(8, "little") + header, 0)
        os.ftruncate(fd, offset + out.header.num_bytes)

    def _write(self, out: Outgoing, start: int, data: memoryview) -> None:
        fd, offset = out.handle
        position, view = offset + start * self.layout.token_bytes, data
        while view:  # pwrite may write less than asked
            n = os.pwrite(fd, view, position)
            view, position = view[n:], position + n

    def _finish(self, out: Outgoing) -> None:
        fd, _ = out.handle
        if out.num_tokens != len(out.header.token_ids):
            raise RuntimeError(f"{out.num_tokens} of {len(out.header.token_ids)} tokens were written")
        os.close(fd)
        out.handle = None
        os.rename(self._path(out.header.transfer_id, False), self._path(out.header.transfer_id, True))

    def _discard(self, out: Outgoing) -> None:
        if out.handle is not None:
            os.close(out.handle[0])
            out.handle = None
        self._path(out.header.transfer_id, False).unlink(missing_ok=True)

    # ---- consumer --------------------------------------------------------------------------------------------
    def claim(self, transfer_id: str) -> Received | None:
        self._sweep()
        path = self._path(transfer_id, True)
        try:
            with path.open("rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = TransferHeader.from_dict(json.loads(f.read(length)))
            if header.transfer_id != transfer_id:
                raise ValueError(f"its header names transfer {header.transfer_id}")
            if header.layout != self.layout:
                raise ValueError(f"its KV layout {header.layout} is not this engine's {self.layout}")
            size = path.stat().st_size
            offset = data_offset(length)
            if size - offset != header.num_bytes:
                raise ValueError(f"{size - offset} bytes of KV for {header.num_bytes} expected")
            raw = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(header.num_bytes,)) \
                if header.num_bytes else np.zeros(0, np.uint8)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            path.unlink(missing_ok=True)
            self.count(dropped_transfers=1)
            raise ValueError(f"transfer {transfer_id}: {e}") from None
        path.unlink(missing_ok=True)  # the mapping stays valid until dropped
        lay = header.layout
        data = torch.from_numpy(raw).view(getattr(torch, lay.dtype)).view(
            len(header.token_ids), lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        self.count(received_transfers=1, received_tokens=len(header.token_ids), received_bytes=header.num_bytes)
        return Received(header, data)

    def _sweep(self) -> None:
        """Remove this directory's files older than ttl_s (unclaimed transfers, a dead producer's partial ones)."""
        now = time.time()
        with self._sweep_lock:
            if now - self._last_sweep < SWEEP_EVERY_S:
                return
            self._last_sweep = now
        for path in self.dir.glob("*.*"):
            try:
                if path.suffix in (".kv", ".part") and now - path.stat().st_mtime > self.config.ttl_s:
                    path.unlink()
                    self.count(dropped_transfers=1)
            except FileNotFoundError:
                pass
