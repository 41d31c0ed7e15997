"""EngineCore: add / abort / step. Owns the scheduler, the KV cache manager and the model runner.

Takes token ids, returns token ids: no text, no HTTP. Offline use drives it in-process; the server runs it in
its own process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig, ModelConfig, default_kv_cache_memory
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.messages import AddRequest, EngineCoreOutput, EngineOutputs
from tokenmill.engine.runner import DTYPES, ModelRunner, StepResult, kv_bytes_per_token
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.step_cost import StepCostModel
from tokenmill.errors import ConfigError
from tokenmill.model.backends import auto_dtype
from tokenmill.model.loader import load_model_config, load_weights, resolve_model_path
from tokenmill.quant.methods import checkpoint_quantization, resolve_quantization
from tokenmill.request import Request, RequestStatus
from tokenmill.spec.speculator import Speculator, build_speculator
from tokenmill.spec.stats import SpecDecodeStats

if TYPE_CHECKING:
    from tokenmill.structured.manager import StructuredOutputs

log = logging.getLogger("tokenmill")


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


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model_config: ModelConfig = load_model_config(path)
        stored = checkpoint_quantization(path)  # an AWQ checkpoint computes as --quantization awq would
        self.dtype = DTYPES[auto_dtype(config.device, config.quantization or stored) if config.dtype == "auto"
                            else config.dtype]
        self.quantization = resolve_quantization(config.quantization, path, self.dtype, config.device)
        weights = load_weights(path, self.model_config, self.dtype)
        mc, cc = self.model_config, config.cache
        self.kv_dtype = cc.cache_dtype(self.dtype)
        per_token = kv_bytes_per_token(mc, self.kv_dtype)
        spec = config.speculative
        draft_per_token = 0  # a draft model's KV, at the same block ids (spec/draft_model.py), shares the budget
        if spec is not None and spec.method == "draft_model":
            draft_per_token = kv_bytes_per_token(load_model_config(resolve_model_path(spec.model)), self.kv_dtype)
        budget = cc.kv_cache_memory or default_kv_cache_memory()
        num_blocks = cc.num_blocks or budget // ((per_token + draft_per_token) * cc.block_size)
        if num_blocks < 1:
            raise ConfigError(f"--kv-cache-memory {budget} bytes holds no block of {cc.block_size} tokens "
                              f"({per_token * cc.block_size} bytes); raise it")
        self.cache_info = CacheInfo(num_blocks, cc.block_size, per_token, str(self.kv_dtype).removeprefix("torch."),
                                    cc.enable_prefix_caching)
        max_len = config.scheduler.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings:
            raise ConfigError(f"--max-model-len {max_len} exceeds the model's {mc.max_position_embeddings} positions")
        self.max_model_len = max_len
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(mc, weights, self.dtype, config.device, num_blocks, cc.block_size, config.seed,
                                  batch_invariant=config.batch_invariant, quantization=self.quantization,
                                  kv_dtype=self.kv_dtype)
        del weights
        self.speculator: Speculator | None = None
        self.step_cost = StepCostModel()  # measured step times: a step's size within an ITL target; a draft's cost
        self.scheduler.step_cost = self.step_cost
        if config.speculative is not None:
            self.speculator = build_speculator(config.speculative, self, self.step_cost)
            self.scheduler.spec_stats = SpecDecodeStats()
            self.scheduler.lookahead = self.cache_info.reserved_tokens = self.speculator.lookahead
        self._unstarted: set[str] = set()  # added, never scheduled yet: reported in `started` when first scheduled
        self.structured: StructuredOutputs | None = None  # made at the first constrained request

    # ---- requests ----------------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> None:
        """Queue one sequence; it passed admission (engine/admission.py) at the edge, so it fits."""
        p, sc = msg.params, self.config.scheduler
        ttft, itl = p.slo_ttft_ms or sc.slo_ttft_ms, p.slo_itl_ms or sc.slo_itl_ms
        request = Request(msg.request_id, msg.prompt_token_ids, p, msg.max_tokens, msg.eos_token_ids,
                          arrival_time=msg.arrival_time, cache_salt=msg.cache_salt, priority=p.priority,
                          ttft_target=ttft / 1e3 if ttft else None, itl_target=itl / 1e3 if itl else None)
        if p.structured_outputs is not None:  # scheduled once its matcher is built (structured/manager.py)
            self._structured().submit(request, msg.grammar)
        else:
            self.scheduler.add_request(request)
        self._unstarted.add(msg.request_id)

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
        for rid in request_ids:
            self._unstarted.discard(rid)
            if self.structured is not None:
                self.structured.discard(rid)
            if self.scheduler.abort(rid) is not None:
                self._release(rid)

    def finish(self, request_id: str, stop_reason: str) -> None:
        """A stop string matched in the detokenizer: end the request now and free its blocks."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)
        self._release(request_id)

    def startup_summary(self) -> str:
        """What a user should see at start-up: the compute path (backend, instruction sets, matmul kernels, batch
        invariance), the weights' format and bytes, and the KV cache."""
        mode = "batch-invariant" if self.runner.batch_invariant else "not batch-invariant"
        spec = f"\n{self.speculator.describe()}" if self.speculator is not None else ""
        return (f"backend: {self.runner.backend.describe()}; {mode}\n{self.runner.weight_summary()}\n"
                f"{self.cache_info.describe()}{spec}")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or (self.structured is not None and self.structured.num_pending > 0)

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self) -> EngineOutputs:
        """Schedule and run one step: the tokens it sampled, and the sequences it scheduled for the first time."""
        outputs = self._admit_constrained()
        sched = self.scheduler.schedule()
        if sched.empty:
            return EngineOutputs(outputs)
        started = {}
        for s in sched.scheduled:
            req = s.request
            if req.request_id in self._unstarted:
                self._unstarted.discard(req.request_id)
                started[req.request_id] = (req.first_scheduled_time, req.num_cached_tokens or 0)
        pairs = sched.num_attention_pairs
        start = time.perf_counter()
        result = self._execute(sched)
        self.step_cost.observe(sched.num_tokens, time.perf_counter() - start, pairs)
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
        for req in finished:
            self._release(req.request_id)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
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
            self._unstarted.discard(request.request_id)
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
        """A request ended (any way): drop its per-request state outside the scheduler."""
        self.runner.release(request_id)
        if self.structured is not None:
            self.structured.release(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Run the step; if it raises, run each request alone so only the one(s) at fault fail. Rerunning is
        safe: nothing is committed before the step returns (KV slots are rewritten with the same values)."""
        try:
            return self.runner.execute(sched)
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
        self.kv.check_idle()
