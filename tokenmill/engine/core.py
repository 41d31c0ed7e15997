"""EngineCore: add / abort / step. Owns the scheduler, the KV cache manager and the model runner.

Takes token ids, returns token ids: no text, no HTTP. Offline use drives it in-process; the server runs it in
its own process.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.constrained_hooks import ConstrainedDecoding
from tokenmill.engine.hooks import RequestHooks
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.kv_transfer_hooks import KVTransferHooks
from tokenmill.engine.lora_hooks import LoRAHooks
from tokenmill.engine.messages import AddRequest, EngineCoreOutput, EngineOutputs
from tokenmill.engine.model_executor import ModelExecutor
from tokenmill.engine.model_spec import ModelSpec, size_kv_cache, threads_per_rank
from tokenmill.engine.multi_step_hook import MultiStepDecode
from tokenmill.engine.pooling import embedding
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_cost import StepCostModel
from tokenmill.engine.step_types import SchedulerOutput, StepResult
from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.model_config import ModelConfig
from tokenmill.request import Request, RequestStatus
from tokenmill.spec.draft_model import DraftTarget
from tokenmill.spec.speculator import Speculator, build_speculator
from tokenmill.spec_stats import SpecDecodeStats

if TYPE_CHECKING:
    from tokenmill.disagg.connector import KVConnector
    from tokenmill.engine.runner import ModelRunner

log = logging.getLogger("tokenmill")


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
        mc = self.model_config
        self.cache_info = size_kv_cache(config, model_spec)
        num_blocks = self.cache_info.num_blocks
        max_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_len} exceeds the model's {mc.max_position_embeddings} positions")
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, config.kv_block_size, self.cache_info.prefix_caching,
                                 self.cache_info.layout, self.cache_info.state_slots, self.cache_info.state_snapshots)
        self.step_cost = StepCostModel()  # measured step times: a step's size within an ITL target; a draft's cost
        spec = config.speculative
        self.scheduler = Scheduler(config.scheduler, self.kv, step_cost=self.step_cost,
                                   lookahead=spec.lookahead if spec is not None else 0,
                                   spec_stats=SpecDecodeStats() if spec is not None else None)
        self.executor = ModelExecutor(config, model_spec, self.cache_info)  # rank 0's runner, and the other ranks
        # each feature's part in a request's life (engine/hooks.py): the core calls them, in this order
        self.hooks: list[RequestHooks] = []
        self.speculator: Speculator | None = None
        if spec is not None:
            target = DraftTarget(self.runner, self.model_config, num_blocks, config.kv_block_size, self.kv_dtype,
                                 config.seed)
            self.speculator = build_speculator(spec, target, self.step_cost, self.scheduler)
        self.connector: KVConnector | None = None  # disaggregated prefill/decode (tokenmill/disagg/)
        self.kv_transfer: KVTransferHooks | None = None
        if config.kv_transfer is not None:
            self.kv_transfer = KVTransferHooks.build(config, self.model_config, self.cache_info, self.kv_dtype,
                                                     self.runner.cache)
            self.connector = self.kv_transfer.connector
            self.hooks.append(self.kv_transfer)
        self.lora = LoRAHooks(self.runner.lora)
        self.hooks.append(self.lora)
        self.constrained = ConstrainedDecoding(self.model_config.vocab_size, self._hf_tokenizer, self.scheduler)
        self.hooks.append(self.constrained)
        if self.speculator is not None:
            self.hooks.append(self.speculator)
        if config.scheduler.num_scheduler_steps > 1 and self.runner.multi_step:  # the runner holds the whole model
            self.hooks.append(MultiStepDecode(config.scheduler.num_scheduler_steps, list(self.hooks)))
        self._unstarted: set[str] = set()  # added, never scheduled yet: reported in `started` when first scheduled

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> None:
        """Queue one sequence; it passed admission (engine/admission.py) at the edge, so it fits. A hook may hold
        it outside the scheduler for now (a grammar to build). If it cannot be queued, whatever it took is
        released before the error goes back."""
        p, sc = msg.params, self.config.scheduler
        ttft, itl = p.slo_ttft_ms or sc.slo_ttft_ms, p.slo_itl_ms or sc.slo_itl_ms
        request = Request(msg.request_id, msg.prompt_token_ids, p, msg.max_tokens, msg.eos_token_ids,
                          arrival_time=msg.arrival_time, cache_salt=msg.cache_salt, priority=p.priority,
                          lora_request=msg.lora_request,
                          ttft_target=ttft / 1e3 if ttft else None, itl_target=itl / 1e3 if itl else None)
        try:
            if msg.kv_transfer is not None and self.kv_transfer is None:
                raise ConfigError("kv_transfer_params: this engine has no --kv-transfer-config")
            held = False
            for hook in self.hooks:
                held = hook.on_add(request, msg) or held
            if not held:
                self.scheduler.add_request(request)
        except BaseException:
            self._end(msg.request_id)
            raise
        self._unstarted.add(msg.request_id)

    def request_ids(self) -> list[str]:
        """Every sequence in the core, whatever stage it is in: held by a hook, waiting, running."""
        return list(dict.fromkeys([*self._unstarted, *self.scheduler.requests]))  # unstarted: held ones too

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
        for hook in self.hooks:
            hook.on_client_end(request_id)
        if status is RequestStatus.FINISHED_ABORTED:
            self.scheduler.abort(request_id)
        else:
            self.scheduler.finish_request(request_id, status, stop_reason)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Every sequence leaves through here, whatever stage it ended in (held by a hook, loading KV, waiting,
        running, preempted, refused, failed, finished): each hook drops what it kept. The scheduler has freed its
        blocks before. Idempotent: a second call finds nothing."""
        self._unstarted.discard(request_id)
        self.runner.release(request_id)
        for hook in self.hooks:
            hook.on_release(request_id)

    # ---- what the engine reports ----------------------------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        """Rank 0's model runner, which the hooks work beside (its LoRA slots, its KV for transfers, a draft)."""
        return self.executor.runner

    def startup_summary(self) -> str:
        """What a user should see at start-up: the compute path (backend, instruction sets, matmul kernels, batch
        invariance, the ranks), the weights' format and bytes, and the KV cache."""
        spec = f"\n{self.speculator.describe()}" if self.speculator is not None else ""
        lora = f"\n{self.runner.lora.describe()}" if self.runner.lora is not None else ""
        return f"{self.executor.describe()}\n{self.cache_info.describe()}{spec}{lora}"

    def check_health(self) -> None:
        """Raise if something the engine depends on has died (a parallel rank)."""
        self.executor.check()

    def _hf_tokenizer(self):
        """The tokenizer a grammar's matcher needs, loaded at the first constrained request."""
        from tokenmill.tokenizer import Tokenizer

        return Tokenizer.load(self.config.tokenizer or self.model_path).hf_tokenizer

    def close(self) -> None:
        """Stop what runs beside the engine: the parallel ranks, the hooks' threads and connections."""
        self.executor.close()
        for hook in self.hooks:
            hook.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or any(hook.pending for hook in self.hooks)

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        """Schedule and run one step: the tokens it sampled, and the sequences it scheduled for the first time."""
        outputs = []
        for hook in self.hooks:
            for rid, why in hook.before_schedule(self.scheduler):
                log.warning("request %s failed: %s", rid, why)
                self._end(rid)
                outputs.append(EngineCoreOutput(rid, [], None, "error", None, str(why),
                                                retry_after=getattr(why, "retry_after", None)))
        sched = self.scheduler.schedule()
        if sched.empty:
            return EngineOutputs(self._on_outputs(outputs, idle=True))
        started = {}
        for s in sched.scheduled:
            req = s.request
            if req.request_id in self._unstarted:
                self._unstarted.discard(req.request_id)
                started[req.request_id] = (req.first_scheduled_time, req.num_cached_tokens or 0)
        pairs = sched.num_attention_pairs
        for hook in self.hooks:
            hook.before_execute(sched)
        start = time.perf_counter()
        result = self._execute(sched)
        self.step_cost.observe(sched.num_tokens, (time.perf_counter() - start) / sched.num_steps, pairs)
        for hook in self.hooks:
            hook.after_execute(sched, result)
        for rid, why in result.failed.items():
            log.error("request %s failed: %s", rid, why)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            self._release(rid)
            outputs.append(EngineCoreOutput(rid, [], None, "error", None, why))
        finished = self.scheduler.update(sched, result.sampled)
        finished += self._finish_pooled(sched, result)
        for hook in self.hooks:
            finished += hook.after_update(sched, result)
        outputs += self._outputs(sched, result)
        for req in sched.preempted:
            for hook in self.hooks:
                hook.on_preempt(req)
        for req in finished:
            self._release(req.request_id)
        return EngineOutputs(self._on_outputs(outputs, idle=False), started)

    def _finish_pooled(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        """Embedding requests take their pooled state; those whose whole prompt is computed now end (their output,
        the embedding, goes out with this step's: _outputs)."""
        done = []
        for s in sched.scheduled:
            req = s.request
            if not req.pools or req.status.finished or req.request_id not in result.pooled:
                continue
            req.pooled = result.pooled[req.request_id]
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                done.append(req)
        return done

    def _outputs(self, sched: SchedulerOutput, result: StepResult) -> list[EngineCoreOutput]:
        """What each scheduled sequence got this step: its tokens (and how it ended), or prompt logprobs alone, or
        an embedding request's embedding as it ends."""
        outputs = []
        for s in sched.scheduled:
            req = s.request
            if req.pools and req.status == RequestStatus.FINISHED_STOPPED and req.request_id in result.pooled:
                outputs.append(EngineCoreOutput(req.request_id, [], None, "stop", None,
                                                num_preemptions=req.num_preemptions, embedding=embedding(req)))
                continue
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
        return outputs

    def _on_outputs(self, outputs: list[EngineCoreOutput], idle: bool) -> list[EngineCoreOutput]:
        for hook in self.hooks:
            outputs = hook.on_outputs(outputs, idle)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the step; if it raises, run each request alone so only the one(s) at fault fail. Rerunning is
        safe for KV: nothing is committed before the step returns (KV slots are rewritten with the same values).
        Not for recurrent state, which a step updates in place: with state layers every request of a failed step
        fails (keeping a copy of every request's state before each step to rerun from costs more than the step's
        recurrence itself: 20 MiB a request on Qwen3.5-0.8B)."""
        try:
            return self.executor.execute(sched)
        except ParallelFailure:
            raise  # the ranks are out of step: no request can run, the engine stops
        except Exception as e:
            if len(sched.scheduled) == 1 or self.cache_info.state_slots:
                ids = [s.request.request_id for s in sched.scheduled]
                log.exception("the forward pass failed for request(s) %s", ", ".join(ids))
                return StepResult(failed={rid: f"{type(e).__name__}: {e}" for rid in ids})
            result = StepResult()
            for s in sched.scheduled:
                result.merge(self._execute(SchedulerOutput([s], draft_probs=sched.draft_probs, grammar=sched.grammar)))
            return result

    def check_idle_invariants(self) -> None:
        """With nothing in flight every block must be free and no hook may keep anything: a leak is a bug."""
        assert not self.has_unfinished and not self._unstarted
        for hook in self.hooks:
            hook.check_idle()
        self.kv.check_idle()
