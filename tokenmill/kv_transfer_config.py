"""KVTransferConfig: --kv-transfer-config, how a disaggregated instance ships or takes KV, and its validation.
Beside the connectors it configures; it imports nothing heavy, so the API process and EngineConfig can read it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import ConfigError
from tokenmill.json_flag import json_flag

KV_CONNECTORS = {"shm": "shm", "sharedmemoryconnector": "shm", "tcp": "tcp", "tcpconnector": "tcp"}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """--kv-transfer-config, the JSON of vLLM's flag: `{"kv_connector": "tcp", "kv_role": "kv_consumer", "kv_port":
    14579}`. A producer computes prompts and ships their KV (tokenmill/disagg/); a consumer takes it into its own
    block pool and decodes. Connectors: `shm` (shared memory, one host: files under `shm_dir`, a directory only this
    user may write) and `tcp` (across hosts: a consumer listens on `kv_ip:kv_port`; a producer connects to the
    address a request names, which must be one of `kv_peers`). `kv_secret` is shared by a producer and its
    consumers (tcp: required; shm: optional, a key file in `shm_dir` otherwise): it authenticates each tcp connection
    both ways and the `transfer_token` a consumer request shows to claim a transfer (tokenmill/disagg/auth.py)."""

    kv_connector: str = "tcp"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a consumer's tcp receiver listens (0.0.0.0: every interface)
    kv_port: int = 14579  # its port (0: any free one, reported at /v1/kv_transfer)
    kv_buffer_size: int = 1 << 30  # bytes of received KV a consumer holds until its requests claim them
    shm_dir: str = "/dev/shm/tokenmill-kv"  # the shm connector's files (a tmpfs: memory, not disk)
    ttl_s: float = 120.0  # received KV no request claims within this is dropped
    kv_peers: list[str] = field(default_factory=list)  # "host:port" of the tcp consumers a producer may ship to
    kv_secret: str | None = field(default=None, repr=False)  # shared by producer and consumers ($TOKENMILL_KV_SECRET)

    KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_buffer_size", "shm_dir", "ttl_s", "kv_peers",
            "kv_secret")
    PEER = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]{0,252}):([0-9]{1,5})"
    MIN_SECRET = 16

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        kw = json_flag(value, "--kv-transfer-config", cls.KEYS, '\'{"kv_connector": "tcp", "kv_role": "kv_consumer"}\'')
        return cls(**kw)

    def __post_init__(self) -> None:
        name = KV_CONNECTORS.get(str(self.kv_connector).lower())
        if name is None:
            raise ConfigError(f"--kv-transfer-config: unknown kv_connector {self.kv_connector!r}; known: shm (one "
                              "host), tcp (across hosts)")
        self.kv_connector = name
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, "
                              f"got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ConfigError(f"--kv-transfer-config: kv_port must be a port number (0: any free one), "
                              f"got {self.kv_port!r}")
        if not isinstance(self.kv_buffer_size, (int, float)) or self.kv_buffer_size < 1 << 20:
            raise ConfigError(f"--kv-transfer-config: kv_buffer_size must be at least 1 MiB (bytes), "
                              f"got {self.kv_buffer_size!r}")
        self.kv_buffer_size = int(self.kv_buffer_size)
        if not isinstance(self.ttl_s, (int, float)) or self.ttl_s <= 0:
            raise ConfigError(f"--kv-transfer-config: ttl_s must be > 0 seconds, got {self.ttl_s!r}")
        self._check_peers()
        self._check_secret()

    def _check_peers(self) -> None:
        if not isinstance(self.kv_peers, (list, tuple)):
            raise ConfigError('--kv-transfer-config: kv_peers must be a list of "host:port" consumer addresses, '
                              f"got {self.kv_peers!r}")
        try:
            self.kv_peers = list(dict.fromkeys(self.peer(p) for p in self.kv_peers))
        except ValueError as e:
            raise ConfigError(f"--kv-transfer-config: kv_peers: {e}") from None

    def _check_secret(self) -> None:
        """Required for tcp: without it anyone who reaches the port could push KV, and any client claim it."""
        if self.kv_secret is None:
            self.kv_secret = os.environ.get("TOKENMILL_KV_SECRET") or None
        if self.kv_secret is not None and (not isinstance(self.kv_secret, str)
                                           or len(self.kv_secret) < self.MIN_SECRET):
            raise ConfigError(f"--kv-transfer-config: kv_secret must be a string of at least {self.MIN_SECRET} "
                              "characters (e.g. from `openssl rand -hex 32`)")
        if self.kv_connector == "tcp" and self.kv_secret is None:
            raise ConfigError("--kv-transfer-config: the tcp connector needs kv_secret (or $TOKENMILL_KV_SECRET), "
                              "the same on a producer and its consumers: it authenticates each connection and each "
                              "claimed transfer")

    @classmethod
    def peer(cls, address: object) -> str:
        """A consumer's address as kv_peers holds it, "host:port" (host lower-cased, IPv6 in brackets); ValueError
        if it is not one. Compared as written: no DNS lookup."""
        import re

        m = re.fullmatch(cls.PEER, address.strip()) if isinstance(address, str) else None
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(f'{address!r} is not a consumer address "host:port" (port 1-65535)')
        return f"{m.group(1).lower()}:{int(m.group(2))}"

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
