"""Disaggregated prefill/decode at the engine core (tokenmill/disagg/): the KV connector's part in each request's
life, as RequestHooks (engine/hooks.py).

A producer's sequence ships its prompt's KV as the steps compute it (`after_execute`, before anything is freed)
and its final output is held until the transfer's outcome is known (`on_outputs`: the router must not send the
decode half before the KV is there). A consumer's sequence claims the KV that arrived under its transfer id
(`on_add`, only with the producer's transfer_token) and writes it into the blocks admission gave it
(`before_execute`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.disagg.kv_io import PagedCache, read_tokens, write_tokens
from tokenmill.disagg.transfer import KVTransferParams, SendResult, TransferLayout
from tokenmill.engine.hooks import RequestHooks
from tokenmill.errors import ConfigError
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.model_config import ModelConfig

if TYPE_CHECKING:
    import torch

    from tokenmill.disagg.connector import KVConnector, Received
    from tokenmill.engine.messages import AddRequest, EngineCoreOutput
    from tokenmill.engine.model_spec import CacheInfo
    from tokenmill.engine.step_types import SchedulerOutput, StepResult
    from tokenmill.request import Request

log = logging.getLogger("tokenmill")


@dataclass
class Shipment:
    """A producer's sequence whose prompt KV is being shipped: prompt tokens handed to the connector so far."""

    transfer_id: str
    sent: int = 0
    ended: bool = False  # the whole prompt is handed over; its outcome comes back through the connector


@dataclass
class ExternalKV:
    """A claimed transfer on the consumer, until every sequence that takes it has loaded it (or ended)."""

    received: Received
    holders: set[str]


class KVTransferHooks(RequestHooks):
    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, cache: CacheInfo, kv_dtype: torch.dtype,
              cache_tensors: PagedCache) -> KVTransferHooks:
        """The connector for --kv-transfer-config, for this model's KV layout, and the hooks around it."""
        from tokenmill.disagg import make_connector

        layout = TransferLayout(model.num_layers, model.num_kv_heads, model.head_dim, cache.dtype, kv_dtype.itemsize)
        return cls(config.kv_transfer, make_connector(config.kv_transfer, layout), cache_tensors, config.kv_block_size)

    def __init__(self, config: KVTransferConfig, connector: KVConnector, cache_tensors: PagedCache, block_size: int):
        self.config, self.connector, self.block_size = config, connector, block_size
        self.cache_tensors = cache_tensors  # where the shipped KV is read and the received KV written
        self._shipments: dict[str, Shipment] = {}  # producer: sequence id -> its shipment
        # producer: transfer id -> (sequence, its final output, held back until the transfer's outcome is known)
        self._awaiting_outcome: dict[str, tuple[str, EngineCoreOutput | None]] = {}
        self._outcomes: dict[str, SendResult] = {}  # sequence id -> its transfer's outcome, before it finished
        self._external: dict[str, ExternalKV] = {}  # consumer: transfer id -> claimed KV
        self._loading_from: dict[str, str] = {}  # sequence id -> the transfer id it loads from

    # ---- RequestHooks ------------------------------------------------------------------------------------------
    def on_add(self, request: Request, msg: AddRequest) -> bool:
        if msg.kv_transfer is not None:
            self._join_transfer(request, msg.kv_transfer)
        return False

    def before_execute(self, sched: SchedulerOutput) -> None:
        if self._loading_from:
            self._load_external(sched)

    def after_execute(self, sched: SchedulerOutput, result: StepResult) -> None:
        if self._shipments:
            self._ship(sched, result)

    def on_outputs(self, outputs: list[EngineCoreOutput], idle: bool) -> list[EngineCoreOutput]:
        if idle:  # only transfers under way: wait a little for their outcome rather than spin
            return self._settle_shipments(outputs, 0.005) if self._awaiting_outcome else outputs
        return self._settle_shipments(outputs) if self._shipments or self._awaiting_outcome else outputs

    def on_preempt(self, request: Request) -> None:
        self._untake(request.request_id)  # recomputed from its prompt (or a cache hit): arrived KV is not kept

    def on_client_end(self, request_id: str) -> None:
        self._forget_shipment(request_id)

    def on_release(self, request_id: str) -> None:
        self._untake(request_id)
        ship = self._shipments.get(request_id)
        if ship is not None and not ship.ended:  # aborted or failed before its prompt was computed
            self.connector.abort(ship.transfer_id)
            del self._shipments[request_id]

    @property
    def pending(self) -> bool:
        return bool(self._awaiting_outcome)

    @property
    def allows_runs(self) -> bool:
        return False  # a step's tokens are shipped or loaded step by step

    def check_idle(self) -> None:
        kept = (self._shipments, self._awaiting_outcome, self._external, self._loading_from, self._outcomes)
        assert not any(kept), "KV transfer state outlived its requests"

    def close(self) -> None:
        self.connector.close()

    # ---- the producer's and the consumer's work ------------------------------------------------------------------
    def _join_transfer(self, request: Request, params: KVTransferParams) -> None:
        """A producer's sequence begins its shipment; a consumer's takes the KV that arrived under its transfer id
        (the longest prefix of its prompt the KV covers, less the last token, whose logits it computes), or, if
        none arrived or its transfer_token is not the producer's (no one claims another's KV), computes its prompt
        as any request does."""
        conn, cfg = self.connector, self.config
        if (params.send and not cfg.produces) or (not params.send and not cfg.consumes):
            raise ConfigError(f"kv_transfer_params: this engine's --kv-transfer-config ({cfg.kv_role}) does not "
                              f"{'ship' if params.send else 'take'} KV")
        tid, rid = params.transfer_id, request.request_id
        if params.send:
            conn.begin(params, request.prompt_token_ids)
            self._shipments[rid] = Shipment(tid)
            return
        if not conn.authorizes(tid, params.transfer_token):
            log.warning("KV transfer %s: request %s shows no valid transfer_token; computing its prompt", tid, rid)
            conn.count(refused_claims=1)
            return
        ext = self._external.get(tid)  # the n samples of one request share one transfer
        if ext is None:
            try:
                received = conn.claim(tid)
            except ValueError as e:
                log.warning("KV transfer %s unusable, computing the prompt: %s", tid, e)
                received = None
            if received is None:
                conn.count(missed_claims=1)
                return
            ext = self._external[tid] = ExternalKV(received, set())
        if request.computes_whole_prompt:  # every prompt position must run through the model: the KV goes unused
            if not ext.holders:
                del self._external[tid]
            return
        shipped, prompt = ext.received.header.token_ids, request.prompt_token_ids
        usable = 0
        for a, b in zip(shipped, prompt[:-1]):
            if a != b:
                break
            usable += 1
        if usable:
            ext.holders.add(rid)
            self._loading_from[rid] = tid
            request.num_external_tokens = usable
        elif not ext.holders:
            del self._external[tid]

    def _forget_shipment(self, request_id: str) -> None:
        """The client is done with a sequence (aborted, or a stop string ended it): no output waits for its
        transfer's outcome any more (a shipment not yet ended is aborted by `on_release`)."""
        for tid, (held, _) in list(self._awaiting_outcome.items()):
            if held == request_id:  # the outcome still comes (has_unfinished waits for it), then goes nowhere
                self._awaiting_outcome[tid] = (request_id, None)
        ship = self._shipments.get(request_id)
        if ship is not None and ship.ended:
            del self._shipments[request_id]
            self._outcomes.pop(request_id, None)

    def _load_external(self, sched: SchedulerOutput) -> None:
        """Write the KV that admission gave each newly admitted consumer sequence, before the step reads it."""
        for s in sched.scheduled:
            req = s.request
            if req.pending_load is None:
                continue
            start, end = req.pending_load
            req.pending_load = None
            ext = self._external[self._loading_from[req.request_id]]
            write_tokens(self.cache_tensors, self.connector.layout, req.block_ids, start, ext.received.data[start:end])
            self.connector.count(loaded_tokens=end - start)
            self._untake(req.request_id)

    def _untake(self, request_id: str) -> None:
        tid = self._loading_from.pop(request_id, None)
        if tid is not None:
            ext = self._external[tid]
            ext.holders.discard(request_id)
            if not ext.holders:
                del self._external[tid]

    def _ship(self, sched: SchedulerOutput, result: StepResult) -> None:
        """After the forward pass, before anything is freed: hand the prompt tokens this step computed (and a
        cache hit's, on the first step) to the connector, and end the shipment with the prompt."""
        for s in sched.scheduled:
            req = s.request
            ship = self._shipments.get(req.request_id)
            if ship is None or ship.ended or req.request_id in result.failed:
                continue
            end = min(req.num_computed_tokens + s.num_new_tokens, req.num_prompt_tokens)
            if end > ship.sent:
                kv = read_tokens(self.cache_tensors, self.connector.layout, req.block_ids, ship.sent, end)
                self.connector.send(ship.transfer_id, ship.sent, kv)
                ship.sent = end
            if end == req.num_prompt_tokens:
                self.connector.end(ship.transfer_id)
                ship.ended = True

    def _settle_shipments(self, outputs: list[EngineCoreOutput], timeout: float = 0.0) -> list[EngineCoreOutput]:
        """Hold each shipping sequence's final output until its transfer's outcome is known (the router must not
        send the decode half before the KV is there), and release those whose outcome came back."""
        kept = []
        for out in outputs:
            ship = self._shipments.get(out.request_id)
            if ship is None or out.finish_reason is None:
                kept.append(out)
            elif out.request_id in self._outcomes:
                out.kv_transfer = self._outcomes.pop(out.request_id).as_params(self.block_size)
                del self._shipments[out.request_id]
                kept.append(out)
            else:  # ended: a sequence samples only once its prompt is shipped (`on_release` aborts the others)
                self._awaiting_outcome[ship.transfer_id] = (out.request_id, out)
                del self._shipments[out.request_id]
        if self._awaiting_outcome or self._shipments:
            for result in self.connector.results(timeout if self._awaiting_outcome else 0.0):
                rid, out = self._awaiting_outcome.pop(result.transfer_id, (None, None))
                if out is not None:
                    out.kv_transfer = result.as_params(self.block_size)
                    kept.append(out)
                elif rid is None:  # still decoding: its final output takes the outcome
                    owner = next((r for r, sh in self._shipments.items() if sh.transfer_id == result.transfer_id),
                                 None)
                    if owner is not None:
                        self._outcomes[owner] = result
        return kept
