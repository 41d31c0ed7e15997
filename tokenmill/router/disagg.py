"""The router's prefill/decode proxy (`tokenmill router --prefill URL --decode URL`): each request runs its prompt on
a prefill instance, which ships the prompt's KV to the decode instance chosen for it, then runs on that decode
instance, which takes the KV instead of computing the prompt and streams the answer to the client.

The two halves are the same OpenAI request: the prefill half asks one token, no stream, no constraints, with
`kv_transfer_params.do_remote_decode` and where to ship; its answer comes once the decode instance holds the whole
KV. The decode half is the client's request with `kv_transfer_params.do_remote_prefill`, the same transfer id and
the prefill answer's `transfer_token`. A failed transfer costs only time: the decode instance computes what did not
arrive.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from tokenmill.router.replicas import Replica, ReplicaPool

# what only the answer's form depends on: the prefill half leaves it out (the prompt's KV is the same without)
ANSWER_ONLY = ("stream", "stream_options", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "stop",
               "stop_token_ids", "min_tokens", "response_format", "structured_outputs", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "n", "best_of", "max_completion_tokens",
               "slo_itl_ms", "logit_bias", "kv_transfer_params")


@dataclass
class KVReceiver:
    """Where a decode instance takes KV, as its /v1/kv_transfer says."""

    connector: str
    host: str | None
    port: int | None


@dataclass
class PDConfig:
    prefill: ReplicaPool
    prefill_policy: Any
    receivers: dict[str, KVReceiver] = field(default_factory=dict)  # decode URL -> where it receives


def prefill_body(data: dict, transfer_id: str, receiver: KVReceiver) -> dict:
    body = {k: v for k, v in data.items() if k not in ANSWER_ONLY}
    body["max_tokens"] = 1
    params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": transfer_id}
    if receiver.connector == "tcp":
        params.update(remote_host=receiver.host, remote_port=receiver.port)
    body["kv_transfer_params"] = params
    return body


def decode_body(data: dict, transfer_id: str, answer: dict | None) -> dict:
    """The decode half: a claim on the transfer, with the `transfer_token` of the prefill answer (the consumer
    gives the KV only to a request that shows it); with no prefill answer, the plain request (nothing to claim)."""
    rest = {k: v for k, v in data.items() if k != "kv_transfer_params"}
    if answer is None:
        return rest
    claim: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": transfer_id}
    params = answer.get("kv_transfer_params")
    token = params.get("transfer_token") if isinstance(params, dict) else None
    if isinstance(token, str) and token:
        claim["transfer_token"] = token
    return {**rest, "kv_transfer_params": claim}


def new_transfer_id() -> str:
    return f"kv-{uuid.uuid4().hex}"


async def kv_receiver(client: httpx.AsyncClient, config: PDConfig, backend: Replica) -> KVReceiver | None:
    """A decode instance's receiver (asked once, then remembered); None if it is not a KV consumer."""
    known = config.receivers.get(backend.url)
    if known is not None:
        return known
    resp = await client.get(backend.url + "/v1/kv_transfer", timeout=5.0)
    if resp.status_code != 200:
        return None
    try:
        info = resp.json()
    except ValueError:
        return None
    if not isinstance(info, dict) or info.get("kv_role") not in ("kv_consumer", "kv_both"):
        return None
    receiver = KVReceiver(info.get("kv_connector", "tcp"), urlparse(backend.url).hostname, info.get("kv_port"))
    config.receivers[backend.url] = receiver
    return receiver
