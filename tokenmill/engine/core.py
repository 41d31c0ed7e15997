"""EngineCore: add / abort / step. Owns the scheduler, the KV cache manager and the model runner.

Takes token ids, returns token ids: no text, no HTTP. Offline use drives it in-process; the server runs it in
its own process.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig, ModelConfig, default_kv_cache_memory
from tokenmill.disagg.transfer import KVLayout, KVTransferParams, SendResult
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.messages import AddRequest, EngineCoreOutput, EngineOutputs
from tokenmill.engine.runner import DTYPES, ModelRunner, StepResult, kv_bytes_per_token
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.step_cost import StepCostModel
from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.model.backends import auto_dtype
from tokenmill.model.loader import load_model_config, load_weights, resolve_model_path
from tokenmill.parallel.context import ContextParallel
from tokenmill.parallel.driver import Workers
from tokenmill.parallel.group import PipelineParallel, TensorParallel, rank_device
from tokenmill.parallel.layout import PPStage, TPLayout, check_pipeline_parallel, check_tensor_parallel
from tokenmill.quant.methods import checkpoint_quantization, resolve_quantization
from tokenmill.request import Request, RequestStatus
from tokenmill.spec.speculator import Speculator, build_speculator
from tokenmill.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from tokenmill.disagg.connector import KVConnector, Received
    from tokenmill.structured.manager import StructuredOutputs

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


@dataclass
class CacheInfo:
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    dtype: str
    prefix_caching: bool = False
    reserved_tokens: int = 0  # slots a draft model writes past a request's tokens (spec/draft_model.py lookahead)

    @property
    def token_capacity(self) -> int:
        """Tokens one request may reach: the pool, less the slots written ahead of it."""
        return self.num_blocks * self.block_size - self.reserved_tokens

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.token_capacity} tokens, "
                f"{self.kv_bytes_per_token} bytes per token ({self.dtype}), "
                f"{self.num_blocks * self.block_size * self.kv_bytes_per_token / 2**20:.0f} MiB; prefix caching "
                f"{'on' if self.prefix_caching else 'off (--no-prefix-caching)'}")


@dataclass
class ModelSpec:
    """What to build the model runner from, resolved once from the config (every tensor-parallel rank the same)."""

    path: Path
    config: ModelConfig
    dtype: torch.dtype
    quantization: str | None
    kv_dtype: torch.dtype

    @classmethod
    def resolve(cls, config: EngineConfig) -> ModelSpec:
        path = resolve_model_path(config.model)
        mc = load_model_config(path)
        stored = checkpoint_quantization(path)  # an AWQ checkpoint computes as --quantization awq would
        dtype = DTYPES[auto_dtype(config.device, config.quantization or stored) if config.dtype == "auto"
                       else config.dtype]
        quantization = resolve_quantization(config.quantization, path, dtype, config.device)
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(mc, config.tensor_parallel_size)
        if config.pipeline_parallel_size > 1:
            check_pipeline_parallel(mc, config.pipeline_parallel_size)
        # context parallelism keeps the whole model on every rank: any weight format
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1 and quantization in ("gguf", "awq", "int4"):
            if config.quantization is not None or stored is not None:
                raise ConfigError(f"--quantization {quantization} keeps blocks that the parallel ranks cannot split "
                                  "yet; use none, int8 or fp8 with --tensor-parallel-size / --pipeline-parallel-size")
            quantization = None  # a GGUF file's blocks, dequantized: each rank takes its slice
        return cls(path, mc, dtype, quantization, config.cache.cache_dtype(dtype))

    def build_runner(self, config: EngineConfig, num_blocks: int, tp: TensorParallel | None = None,
                     pp: PipelineParallel | None = None, cp: ContextParallel | None = None) -> ModelRunner:
        weights = load_weights(self.path, self.config, self.dtype)
        group = next((p.group for p in (tp, pp, cp) if p is not None), None)
        device = (rank_device(config.device, group.rank, config.parallel_size // config.nnodes) if group is not None
                  else config.device)
        return ModelRunner(self.config, weights, self.dtype, device, num_blocks, config.kv_block_size,
                           config.seed, batch_invariant=config.batch_invariant, quantization=self.quantization,
                           kv_dtype=self.kv_dtype, tp=tp, pp=pp, cp=cp)


def threads_per_rank(config: EngineConfig) -> int | None:
    """--threads, or with several parallel ranks on this host the cores shared out among them."""
    if config.num_threads is not None or config.parallel_size == 1:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // (config.parallel_size // config.nnodes))


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        threads = threads_per_rank(config)
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        model_spec = ModelSpec.resolve(config)
        self.model_path = model_spec.path
        self.model_config: ModelConfig = model_spec.config
        self.dtype, self.quantization, self.kv_dtype = model_spec.dtype, model_spec.quantization, model_spec.kv_dtype
        mc, cc = self.model_config, config.cache
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        layout = TPLayout(mc, tp_size, 0) if tp_size > 1 else None
        per_rank = layout.shard_config() if layout else mc
        if pp_size > 1:  # every stage has as many blocks: sized by the stage with the most layers
            per_rank = PPStage.of(mc, pp_size, pp_size - 1).shard_config(per_rank)
        per_token = kv_bytes_per_token(per_rank, self.kv_dtype)  # per rank
        spec = config.speculative
        draft_per_token = 0  # a draft model's KV, at the same block ids (spec/draft_model.py), shares the budget
        if spec is not None and spec.method == "draft_model":
            draft_per_token = kv_bytes_per_token(load_model_config(resolve_model_path(spec.model)), self.kv_dtype)
        budget = cc.kv_cache_memory or default_kv_cache_memory()
        num_blocks = cc.num_blocks or budget // ((per_token + draft_per_token) * cc.block_size)
        if num_blocks < 1:
            raise ConfigError(f"--kv-cache-memory {budget} bytes holds no block of {cc.block_size} tokens "
                              f"({per_token * cc.block_size} bytes); raise it")
        # context parallelism: a block is block_size tokens on each rank (parallel/context.py), per_token is whole
        self.cache_info = CacheInfo(num_blocks, config.kv_block_size, per_token, str(self.kv_dtype).removeprefix("torch."),
                                    cc.enable_prefix_caching)
        max_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_len} exceeds the model's {mc.max_position_embeddings} positions")
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, config.kv_block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.workers: Workers | None = None  # tensor-parallel ranks or pipeline stages 1..N-1
        tp = pp = cp = None
        if config.parallel_size > 1:
            self.workers = Workers(config, num_blocks, config.parallel_size)
            if layout is not None:
                tp = TensorParallel(self.workers.group, layout)
            if pp_size > 1:
                pp = PipelineParallel(self.workers.group, PPStage.of(mc, pp_size, 0),
                                      config.pipeline_micro_batches or pp_size)
            if config.context_parallel_size > 1:
                cp = ContextParallel(self.workers.group, cc.block_size, num_blocks)
        try:
            self.runner = model_spec.build_runner(config, num_blocks, tp, pp, cp)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            raise
        self.speculator: Speculator | None = None
        self.step_cost = StepCostModel()  # measured step times: a step's size within an ITL target; a draft's cost
        self.scheduler.step_cost = self.step_cost
        if config.speculative is not None:
            self.speculator = build_speculator(config.speculative, self, self.step_cost)
            self.scheduler.spec_stats = SpecDecodeStats()
            self.scheduler.lookahead = self.cache_info.reserved_tokens = self.speculator.lookahead
        # multi-step decode where the runner holds the whole model and nothing acts between tokens (drafts)
        self.num_steps = (config.scheduler.num_scheduler_steps if getattr(self.runner, "multi_step", False)
                          and self.speculator is None and config.kv_transfer is None else 1)
        self._unstarted: set[str] = set()  # added, never scheduled yet: reported in `started` when first scheduled
        self.structured: StructuredOutputs | None = None  # made at the first constrained request
        # disaggregated prefill/decode (tokenmill/disagg/): the connector, a producer's shipments and the finished
        # outputs held until their transfer's outcome, a consumer's claimed transfers
        self.connector: KVConnector | None = None
        self._shipments: dict[str, Shipment] = {}
        self._held: dict[str, tuple[str, EngineCoreOutput | None]] = {}  # transfer id -> sequence, final output
        self._outcomes: dict[str, SendResult] = {}  # sequence id -> its transfer's outcome, before it finished
        self._external: dict[str, ExternalKV] = {}  # transfer id -> claimed KV
        self._takes: dict[str, str] = {}  # sequence id -> the transfer id it loads from
        if config.kv_transfer is not None:
            from tokenmill.disagg import make_connector

            mc = self.model_config
            self.connector = make_connector(config.kv_transfer, KVLayout(
                mc.num_layers, mc.num_kv_heads, mc.head_dim, self.cache_info.dtype, self.kv_dtype.itemsize))

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> None:
        """Queue one sequence; it passed admission (engine/admission.py) at the edge, so it fits. If it cannot be
        queued, whatever it had taken (a KV transfer) is released before the error goes back."""
        p, sc = msg.params, self.config.scheduler
        ttft, itl = p.slo_ttft_ms or sc.slo_ttft_ms, p.slo_itl_ms or sc.slo_itl_ms
        request = Request(msg.request_id, msg.prompt_token_ids, p, msg.max_tokens, msg.eos_token_ids,
                          arrival_time=msg.arrival_time, cache_salt=msg.cache_salt, priority=p.priority,
                          ttft_target=ttft / 1e3 if ttft else None, itl_target=itl / 1e3 if itl else None)
        try:
            if msg.kv_transfer is not None:
                self._join_transfer(request, msg.kv_transfer)
            if p.structured_outputs is not None:  # scheduled once its matcher is built (structured/manager.py)
                self._structured().submit(request, msg.grammar)
            else:
                self.scheduler.add_request(request)
        except BaseException:
            self._end(msg.request_id)
            raise
        self._unstarted.add(msg.request_id)

    def request_ids(self) -> list[str]:
        """Every sequence in the core, whatever stage it is in: waiting for its grammar, waiting, running."""
        return list(dict.fromkeys([*self._unstarted, *self.scheduler.requests]))  # unstarted: grammar ones too

    # ---- disaggregated prefill/decode ------------------------------------------------------------------------
    def _join_transfer(self, request: Request, params: KVTransferParams) -> None:
        """A producer's sequence begins its shipment; a consumer's takes the KV that arrived under its transfer id
        (the longest prefix of its prompt the KV covers, less the last token, whose logits it computes), or, if
        none arrived or its transfer_token is not the producer's (no one claims another's KV), computes its prompt
        as any request does."""
        conn, cfg = self.connector, self.config.kv_transfer
        if conn is None or (params.send and not cfg.produces) or (not params.send and not cfg.consumes):
            raise ConfigError(f"kv_transfer_params: this engine's --kv-transfer-config "
                              f"({cfg.kv_role if cfg else 'none'}) does not {'ship' if params.send else 'take'} KV")
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
        if request.wants_prompt_logprobs:  # every prompt position must run through the model: the KV goes unused
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
            self._takes[rid] = tid
            request.num_external_tokens = usable
        elif not ext.holders:
            del self._external[tid]

    def _forget_shipment(self, request_id: str) -> None:
        """The client is done with a sequence (aborted, or a stop string ended it): no output waits for its
        transfer's outcome any more (a shipment not yet ended is aborted by `_release`)."""
        for tid, (held, _) in list(self._held.items()):
            if held == request_id:  # the outcome still comes (has_unfinished waits for it), then goes nowhere
                self._held[tid] = (request_id, None)
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
            ext = self._external[self._takes[req.request_id]]
            self.runner.write_kv(req.block_ids, start, ext.received.data[start:end])
            self.connector.count(loaded_tokens=end - start)
            self._untake(req.request_id)

    def _untake(self, request_id: str) -> None:
        tid = self._takes.pop(request_id, None)
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
                self.connector.send(ship.transfer_id, ship.sent, self.runner.read_kv(req.block_ids, ship.sent, end))
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
                out.kv_transfer = self._outcomes.pop(out.request_id).as_params(self.cache_info.block_size)
                del self._shipments[out.request_id]
                kept.append(out)
            else:  # ended: a sequence samples only once its prompt is shipped (`_release` aborts the others)
                self._held[ship.transfer_id] = (out.request_id, out)
                del self._shipments[out.request_id]
        if self.connector is not None and (self._held or self._shipments):
            for result in self.connector.results(timeout if self._held else 0.0):
                rid, out = self._held.pop(result.transfer_id, (None, None))
                if out is not None:
                    out.kv_transfer = result.as_params(self.cache_info.block_size)
                    kept.append(out)
                elif rid is None:  # still decoding: its final output takes the outcome
                    owner = next((r for r, sh in self._shipments.items() if sh.transfer_id == result.transfer_id),
                                 None)
                    if owner is not None:
                        self._outcomes[owner] = result
        return kept

    def _structured(self) -> StructuredOutputs:
        if self.structured is None:
            from tokenmill.structured.manager import StructuredOutputs
            from tokenmill.tokenizer import Tokenizer

            path = self.config.tokenizer or self.model_path
            self.structured = StructuredOutputs(self.model_config.vocab_size,
                                                lambda: Tokenizer.load(path).hf_tokenizer)
            self.runner.structured = self.structured
        return self.structured

    def abort(self, request_ids: list[str]) -> None:
        """End sequences now (client gone, stopping), whatever stage they are in."""
        for rid in request_ids:
            self._end(rid)

    def abort_all(self) -> None:
        self.abort(self.request_ids())

    def finish(self, request_id: str, stop_reason: str) -> None:
        """A stop string matched in the detokenizer: end the request now and free its blocks."""
        self._end(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def _end(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
             stop_reason: str | None = None) -> None:
        """Ended from outside a step (abort, stop string, refused at add): the scheduler frees its blocks if it
        holds it, and it leaves through `_release` as every request does. Idempotent."""
        self._forget_shipment(request_id)
        if status is RequestStatus.FINISHED_ABORTED:
            self.scheduler.abort(request_id)
        else:
            self.scheduler.finish_request(request_id, status, stop_reason)
        self._release(request_id)

    def startup_summary(self) -> str:
        """What a user should see at start-up: the compute path (backend, instruction sets, matmul kernels, batch
        invariance), the weights' format and bytes, and the KV cache."""
        mode = "batch-invariant" if self.runner.batch_invariant else "not batch-invariant"
        spec = f"\n{self.speculator.describe()}" if self.speculator is not None else ""
        tp, cfg = "", self.config
        if cfg.tensor_parallel_size > 1:
            tp = (f"\n{TPLayout(self.model_config, cfg.tensor_parallel_size, 0).describe()}; "
                  f"{torch.get_num_threads()} threads each; weights and KV cache below are per rank")
        if cfg.pipeline_parallel_size > 1:
            tp += (f"\n{PPStage.describe(self.model_config, cfg.pipeline_parallel_size, self.runner.pp.micro_batches)}"
                  f"; {torch.get_num_threads()} threads each; weights and KV cache below are rank 0's")
        if cfg.context_parallel_size > 1:
            tp += (f"\n{self.runner.cp.describe(self.cache_info.num_blocks)}; {torch.get_num_threads()} threads each; "
                   "weights below are per rank, the KV cache is across the ranks")
        return (f"backend: {self.runner.backend.describe()}; {mode}{tp}\n{self.runner.weight_summary()}\n"
                f"{self.cache_info.describe()}{spec}")

    def check_health(self) -> None:
        """Raise if something the engine depends on has died (a tensor-parallel rank)."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop what runs beside the engine: the tensor-parallel ranks, the KV connector's threads."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        if self.connector is not None:
            self.connector.close()

    @property
    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished or (self.structured is not None and self.structured.num_pending > 0)
                or bool(self._held))

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        """Schedule and run one step: the tokens it sampled, and the sequences it scheduled for the first time."""
        outputs = self._admit_constrained()
        # constrained requests advance their grammar token by token: one step at a time while any is here
        self.scheduler.max_steps = 1 if self.structured is not None and len(self.structured) else self.num_steps
        sched = self.scheduler.schedule()
        if sched.empty:
            if self._held:  # only transfers under way: wait a little for their outcome rather than spin
                outputs = self._settle_shipments(outputs, 0.005)
            return EngineOutputs(outputs)
        started = {}
        for s in sched.scheduled:
            req = s.request
            if req.request_id in self._unstarted:
                self._unstarted.discard(req.request_id)
                started[req.request_id] = (req.first_scheduled_time, req.num_cached_tokens or 0)
        pairs = sched.num_attention_pairs
        if self._takes:
            self._load_external(sched)
        start = time.perf_counter()
        result = self._execute(sched)
        self.step_cost.observe(sched.num_tokens, (time.perf_counter() - start) / sched.num_steps, pairs)
        if self._shipments:
            self._ship(sched, result)
        for rid, why in result.failed.items():
            log.error("request %s failed: %s", rid, why)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            self._release(rid)
            outputs.append(EngineCoreOutput(rid, [], None, "error", None, why))
        verified = [(s.request.request_id, s.num_spec_tokens, len(result.sampled[s.request.request_id].token_ids) - 1)
                    for s in sched.scheduled if s.num_spec_tokens and s.request.request_id in result.sampled]
        finished = self.scheduler.update(sched, result.sampled)
        if self.structured is not None and len(self.structured):
            finished += self._advance_grammars(sched, result)
        for s in sched.scheduled:
            req = s.request
            prompt_lps = result.prompt_logprobs.get(req.request_id)
            if prompt_lps is not None:
                req.num_prompt_logprobs += len(prompt_lps)
            if req.request_id in result.sampled:
                got = result.sampled[req.request_id]
                outputs.append(EngineCoreOutput(req.request_id, got.token_ids, got.logprobs,
                                                req.finish_reason, req.stop_reason,
                                                num_preemptions=req.num_preemptions, new_prompt_logprobs=prompt_lps))
            elif prompt_lps is not None and req.request_id not in result.failed:
                outputs.append(EngineCoreOutput(req.request_id, [], num_preemptions=req.num_preemptions,
                                                new_prompt_logprobs=prompt_lps))
        if self.speculator is not None:
            for rid, drafts, accepted in verified:  # before the finished are released: they forget it all
                self.speculator.observe(rid, drafts, accepted)
            for req in sched.preempted:
                self.speculator.forget(req.request_id)  # its KV is gone: a draft model starts it over
        for req in sched.preempted:  # recomputed from its prompt (or a cache hit): arrived KV is not kept for it
            self._untake(req.request_id)
        for req in finished:
            self._release(req.request_id)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        if self._shipments or self._held:
            outputs = self._settle_shipments(outputs)
        return EngineOutputs(outputs, started)

    def _admit_constrained(self) -> list[EngineCoreOutput]:
        """Constrained requests whose matcher is built join the scheduler; those whose grammar failed end with an
        error. With nothing else to run, waits a little for a build rather than spin."""
        if self.structured is None or not self.structured.num_pending:
            return []
        ok, failed = self.structured.ready(0.0 if self.scheduler.has_unfinished else 0.005)
        for request in ok:
            self.scheduler.add_request(request)
        for request, why in failed:
            self._end(request.request_id)
            log.warning("request %s failed: %s", request.request_id, why)
        return [EngineCoreOutput(r.request_id, [], None, "error", None, why) for r, why in failed]

    def _advance_grammars(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        """Constrained requests' matchers consume the tokens kept. A grammar that has ended lets only EOS through,
        which ends the request as usual; with ignore_eos it ends here, on that EOS (as a stop, the EOS's text
        hidden); a refused token ends it too."""
        ended = []
        for s in sched.scheduled:
            req, got = s.request, result.sampled.get(s.request.request_id)
            if got is None or req.request_id not in self.structured or req.status.finished:
                continue
            state = self.structured.advance(req.request_id, got.token_ids)
            if state == "error":
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                ended.append(req)
            elif state == "stopped" and got.token_ids[-1:] and got.token_ids[-1] in req.eos_token_ids:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                ended.append(req)
        return ended

    def _release(self, request_id: str) -> None:
        """Every sequence leaves through here, whatever stage it ended in (waiting for its grammar, loading KV,
        waiting, running, preempted, refused, failed, finished): its state outside the scheduler goes. The
        scheduler has freed its blocks before. Idempotent: a second call finds nothing."""
        self._unstarted.discard(request_id)
        self.runner.release(request_id)
        self._untake(request_id)
        ship = self._shipments.get(request_id)
        if ship is not None and not ship.ended:  # aborted or failed before its prompt was computed
            self.connector.abort(ship.transfer_id)
            del self._shipments[request_id]
        if self.structured is not None:
            self.structured.release(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the step; if it raises, run each request alone so only the one(s) at fault fail. Rerunning is
        safe: nothing is committed before the step returns (KV slots are rewritten with the same values)."""
        try:
            return self.runner.execute(sched)
        except ParallelFailure:
            raise  # the ranks are out of step: no request can run, the engine stops
        except Exception as e:
            if len(sched.scheduled) == 1:
                log.exception("the forward pass failed for request %s", sched.scheduled[0].request.request_id)
                return StepResult(failed={sched.scheduled[0].request.request_id: f"{type(e).__name__}: {e}"})
            result = StepResult()
            for s in sched.scheduled:
                result.merge(self._execute(SchedulerOutput([s])))
            return result

    def check_idle_invariants(self) -> None:
        """With nothing in flight every block must be free: a leak is a bug."""
        assert not self.has_unfinished and not self._unstarted
        assert self.structured is None or not len(self.structured)
        assert not (self._shipments or self._held or self._external or self._takes or self._outcomes), \
            "KV transfer state outlived its requests"
        self.kv.check_idle()
