"""Disaggregated prefill and decode: a producer instance computes prompts and ships their KV, a consumer instance
takes it into its own block pool and decodes (transfer.py: what crosses; connector.py: how, shm.py and tcp.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.disagg.connector import KVConnector
    from tokenmill.disagg.transfer import TransferLayout
    from tokenmill.kv_transfer_config import KVTransferConfig


def make_connector(config: KVTransferConfig, layout: TransferLayout) -> KVConnector:
    """The connector `config.kv_connector` names (torch is imported here, in the engine process only)."""
    if config.kv_connector == "shm":
        from tokenmill.disagg.shm import SharedMemoryConnector

        return SharedMemoryConnector(config, layout)
    from tokenmill.disagg.tcp import TcpConnector

    return TcpConnector(config, layout)
