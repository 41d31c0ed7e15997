"""Who may move KV and who may take it: one secret, `kv_secret`, shared by a producer and its consumers.

- tcp: each connection is authenticated both ways before any KV moves (tcp.py). The consumer sends a fresh nonce,
  the producer answers with its own nonce and an HMAC of both, the consumer answers with its HMAC of both under
  another label: neither side can replay an old answer or reflect the other's, and a producer never streams KV to
  a listener that does not hold the secret.
- Claims: a producer's answer carries `transfer_token` = HMAC(secret, transfer id). A consumer request must show it
  to take that transfer, so a client cannot claim KV that another request had shipped.
- shm: `kv_secret` is optional. The directory must be writable by this user only (else another local user could
  plant KV files or links), and without a secret the key is a random file in it that both sides read: whoever can
  read it can read the KV files anyway.

No encryption: KV and prompt token ids cross the network in clear (run tcp on a private network or a tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.kv_transfer_config import KVTransferConfig

SHM_KEY_FILE = ".kv_secret"  # no suffix: never taken for a transfer's file (`<id>.kv`, `<id>.part`)
_shm_keys: dict[str, bytes] = {}
_shm_lock = threading.Lock()


def shared_key(config: KVTransferConfig) -> bytes:
    """The key both sides sign with: `kv_secret`, or for shm without one the key file in `shm_dir`."""
    if config.kv_secret is not None:
        return config.kv_secret.encode()
    if config.kv_connector != "shm":
        raise ConfigError("--kv-transfer-config: the tcp connector needs kv_secret")
    return shm_key(Path(config.shm_dir))


def shm_key(directory: Path) -> bytes:
    """The random key in a private shm directory, made by whichever side comes first (link: never seen half
    written), then read by every other."""
    with _shm_lock:
        known = _shm_keys.get(str(directory))
        if known is not None:
            return known
        path = private_dir(directory) / SHM_KEY_FILE
        if not path.exists():
            tmp = directory / f"{SHM_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # the other side made it first: use theirs
            finally:
                tmp.unlink()
        key = path.read_bytes().strip()
        if len(key) < 32:
            raise ConfigError(f"--kv-transfer-config: {path} is not a tokenmill KV key; remove it")
        _shm_keys[str(directory)] = key
        return key


def private_dir(directory: Path) -> Path:
    """`shm_dir`, made if missing; ConfigError if another user owns it or may write in it (a shared /dev/shm
    name another user made first, to plant KV files or links there)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.lstat()
    except OSError as e:
        raise ConfigError(f"--kv-transfer-config: shm_dir {directory}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"--kv-transfer-config: shm_dir {directory} is not a directory (a link?)")
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"--kv-transfer-config: shm_dir {directory} is owned by uid {st.st_uid} with mode "
                          f"{stat.S_IMODE(st.st_mode):o}: it must be this user's (uid {os.getuid()}) and writable by "
                          "no one else, or others could plant KV; choose another shm_dir")
    return directory


def transfer_token(key: bytes, transfer_id: str) -> str:
    """The proof that a producer holding `key` shipped `transfer_id`: a consumer request shows it to claim it."""
    return hmac.new(key, b"tokenmill-kv-transfer\0" + transfer_id.encode(), hashlib.sha256).hexdigest()


def token_matches(key: bytes, transfer_id: str, token: object) -> bool:
    """Compared in constant time: a wrong token's timing tells nothing about the right one."""
    return isinstance(token, str) and hmac.compare_digest(token.encode(), transfer_token(key, transfer_id).encode())


def new_nonce() -> str:
    return secrets.token_hex(16)


def handshake_mac(key: bytes, side: str, consumer_nonce: str, producer_nonce: str) -> str:
    """What `side` ("producer" or "consumer") sends to prove it holds the key, bound to both fresh nonces."""
    msg = f"tokenmill-kv-handshake\0{side}\0{consumer_nonce}\0{producer_nonce}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def mac_matches(given: object, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
