"""What a KV transfer is, as plain data (no torch: the API process and the router use these too).

A request's `kv_transfer_params` (vLLM's field) says its part: `{"do_remote_decode": true, "transfer_id": ID,
"remote_host": H, "remote_port": P}` on a producer (compute the prompt, ship its KV to H:P, or through shared
memory; with tcp, H:P must be one of the producer's `kv_peers`: a client does not choose where a server connects),
`{"do_remote_prefill": true, "transfer_id": ID, "transfer_token": T}` on a consumer (take the KV shipped under ID,
compute only what did not arrive; T proves the producer shipped ID for whoever shows it, auth.py). A producer's
answer carries `kv_transfer_params` back: the outcome, tokens, bytes, timings, and the transfer's token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.disagg.auth import shared_key, token_matches
from tokenmill.errors import InvalidRequest
from tokenmill.kv_transfer_config import KVTransferConfig

TRANSFER_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # it names a file (shm) and travels in a header (tcp)
PARAM = "kv_transfer_params"


@dataclass(frozen=True)
class KVTransferParams:
    """One request's part in a transfer, checked at the edge."""

    transfer_id: str
    send: bool  # True: a producer's (ship the prompt's KV); False: a consumer's (take it)
    remote_host: str | None = None  # the consumer's tcp receiver (send, tcp connector): one of kv_peers
    remote_port: int | None = None
    transfer_token: str | None = None  # a consumer's proof that the producer shipped `transfer_id` (auth.py)

    @classmethod
    def from_request(cls, value: Any, config: KVTransferConfig | None) -> KVTransferParams | None:
        """From the request body's field; InvalidRequest (HTTP 400) naming the field and the fix."""
        if value is None:
            return None
        if config is None:
            raise InvalidRequest("this server was started without --kv-transfer-config, so it neither ships nor "
                                 "takes KV", param=PARAM)
        if not isinstance(value, dict):
            raise InvalidRequest(f"{PARAM} must be an object", param=PARAM)
        tid = value.get("transfer_id")
        if not isinstance(tid, str) or not TRANSFER_ID.fullmatch(tid):
            raise InvalidRequest(f"{PARAM}.transfer_id must be 1-128 characters of letters, digits, '_', '-', '.'",
                                 param=PARAM)
        send, take = value.get("do_remote_decode") is True, value.get("do_remote_prefill") is True
        if send == take:
            raise InvalidRequest(f"{PARAM} needs exactly one of do_remote_decode (on a producer: ship the prompt's "
                                 "KV) and do_remote_prefill (on a consumer: take it)", param=PARAM)
        if send and not config.produces:
            raise InvalidRequest(f"do_remote_decode: this server's kv_role is {config.kv_role}, not a producer",
                                 param=PARAM)
        if take and not config.consumes:
            raise InvalidRequest(f"do_remote_prefill: this server's kv_role is {config.kv_role}, not a consumer",
                                 param=PARAM)
        if send:
            return cls(tid, True, *destination(value, config))
        return cls(tid, False, transfer_token=proof(value, config, tid))


def destination(value: dict[str, Any], config: KVTransferConfig) -> tuple[str | None, int | None]:
    """Where a producer's request ships (tcp): one of the operator's kv_peers, never any address a client names."""
    if config.kv_connector != "tcp":
        return None, None
    host, port = value.get("remote_host"), value.get("remote_port")
    if not (isinstance(host, str) and host and isinstance(port, int) and not isinstance(port, bool)
            and 0 < port < 65536):
        raise InvalidRequest(f"{PARAM}: the tcp connector ships to remote_host and remote_port (the consumer's "
                             "kv_ip and kv_port, as its /v1/kv_transfer says)", param=PARAM)
    bare = host.strip("[]")
    try:
        address = KVTransferConfig.peer(f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}")
    except ValueError:
        raise InvalidRequest(f"{PARAM}.remote_host must be a host name or an IP address", param=PARAM) from None
    if address not in config.kv_peers:
        raise InvalidRequest(f"{PARAM}: {address} is not one of this producer's kv_peers; it ships KV only to the "
                             "consumers its operator names (--kv-transfer-config kv_peers, or POST /admin/kv_peers)",
                             param=PARAM)
    return bare, port


def proof(value: dict[str, Any], config: KVTransferConfig, transfer_id: str) -> str:
    """A consumer's claim must show the token the producer's answer gave for this transfer id."""
    token = value.get("transfer_token")
    if not isinstance(token, str) or not token:
        raise InvalidRequest(f"{PARAM}.transfer_token is required with do_remote_prefill: pass on the "
                             "transfer_token of the producer's answer (its kv_transfer_params)", param=PARAM)
    if not token_matches(shared_key(config), transfer_id, token):
        raise InvalidRequest(f"{PARAM}.transfer_token is not the producer's token for transfer_id {transfer_id} "
                             "(or the producer and this server do not share kv_secret)", param=PARAM)
    return token


@dataclass(frozen=True)
class TransferLayout:
    """The shape of one token's KV: both sides must agree, or the consumer computes the prompt itself."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    itemsize: int

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    def as_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "itemsize": self.itemsize}


@dataclass
class TransferHeader:
    """What opens a transfer: its id, the KV layout and the prompt whose KV follows (token by token, in order)."""

    transfer_id: str
    layout: TransferLayout
    token_ids: list[int]

    @property
    def num_bytes(self) -> int:
        return len(self.token_ids) * self.layout.token_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "layout": self.layout.as_dict(), "token_ids": self.token_ids}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferHeader:
        tid = d["transfer_id"]
        if not isinstance(tid, str) or not TRANSFER_ID.fullmatch(tid):
            raise ValueError(f"bad transfer id {tid!r}")
        tokens = d["token_ids"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("token_ids must be a list of integers")
        return cls(tid, TransferLayout(**d["layout"]), tokens)


@dataclass
class SendResult:
    """How a producer's transfer ended: sent whole (the consumer has it all) or failed (it has nothing)."""

    transfer_id: str
    ok: bool
    num_tokens: int = 0
    num_bytes: int = 0
    seconds: float = 0.0  # from the first KV handed to the connector to the consumer's acknowledgement
    tail_seconds: float = 0.0  # of which after the prompt's last step: the part not overlapped with compute
    error: str | None = None
    token: str | None = None  # the transfer's token (auth.py): the consumer request that shows it may claim it

    def as_params(self, block_size: int) -> dict[str, Any]:
        """The producer's answer's `kv_transfer_params`: what the router passes on to the consumer, and timings."""
        d: dict[str, Any] = {"transfer_id": self.transfer_id, "status": "sent" if self.ok else "failed",
                             "num_tokens": self.num_tokens, "num_blocks": -(-self.num_tokens // block_size),
                             "num_bytes": self.num_bytes, "transfer_seconds": round(self.seconds, 6),
                             "tail_seconds": round(self.tail_seconds, 6)}
        if self.error:
            d["error"] = self.error
        if self.token:
            d["transfer_token"] = self.token
        return d


@dataclass
class KVTransferStats:
    """Cumulative counters of one engine's connector (both roles), for /metrics."""

    role: str = ""
    connector: str = ""
    sent_transfers: int = 0
    failed_sends: int = 0
    sent_tokens: int = 0
    sent_bytes: int = 0
    received_transfers: int = 0
    received_tokens: int = 0
    received_bytes: int = 0
    dropped_transfers: int = 0  # refused (buffer full, bad header), broken off, or expired unclaimed
    rejected_connections: int = 0  # tcp connections in that did not prove they hold kv_secret
    refused_claims: int = 0  # consumer requests whose transfer_token did not match (they computed their prompt)
    loaded_tokens: int = 0  # tokens a consumer's requests took instead of computing them
    missed_claims: int = 0  # consumer requests whose KV had not arrived (they computed their prompt)
    buffered_bytes: int = 0  # gauge: received KV waiting to be claimed
    send_seconds: list[float] = field(default_factory=list)  # per transfer since the last report (drained)
