"""ModelRunner: SchedulerOutput -> one flat token batch + attention metadata -> forward -> sampled tokens.

The one place in the engine that builds tensors. It owns the model, the KV cache tensors and each request's
random generator. How a step's inputs are built (engine/step_inputs.py) and how a multi-step decode runs
(engine/multi_step_runner.py) are mixins of their own.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from tokenmill.engine.cache_tensors import CacheTensors
from tokenmill.engine.kv_layout import KVLayout
from tokenmill.engine.lora_pool import LoRAPool
from tokenmill.engine.multi_step_runner import MultiStepRunner, request_stop_ids
from tokenmill.engine.rejection import rejection_sample
from tokenmill.engine.sampler import Sampler, SamplingRow, top_logprobs
from tokenmill.engine.step_inputs import StepInputs, micro_batches
from tokenmill.engine.step_types import SampledTokens, ScheduledRequest, SchedulerOutput, StepResult
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import select_backend
from tokenmill.model.loader import allocate_parameters
from tokenmill.model.registry import model_class
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.driver import model_calls
from tokenmill.parallel.layout import ShardedCheckpoint, StageCheckpoint
from tokenmill.quant.methods import linear_method

if TYPE_CHECKING:
    from tokenmill.parallel.context import ContextParallel
    from tokenmill.parallel.group import PipelineParallel, TensorParallel
    from tokenmill.request import Request

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Prompt logprobs are computed this many rows at a time: the logits of a 2k-token prompt over a 49k vocabulary
# would be 400 MB in float32 at once, and twice that with log_softmax.
PROMPT_LOGPROB_ROWS = 256


def position_seed(base: int, position: int) -> int:
    """The seed of one output position's draw (splitmix64 of the request's base seed and the position): a token's
    randomness depends on where it is, not on how many draws came before, so a seeded request samples the same
    tokens with or without speculation (a verify pass draws for positions it may not keep)."""
    z = (base + (position + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights: parameters, buffers and the backend's packed or quantized copies, each
    tensor once (a released plain weight, on the meta device, holds none)."""
    tensors = [*model.parameters(), *model.buffers(), getattr(getattr(model, "embed_tokens", None), "kept", None)]
    for m in model.linear_layers():
        tensors += [getattr(m, a, None) for a in ("weight", "packed_weight", "qweight", "weight_scale", "pair_scale",
                                                  "gguf_blocks")]
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.is_mkldnn:  # a oneDNN-packed weight: no storage to share
            total += t.numel() * t.element_size()
            continue
        if t is None or t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token_per_element * dtype.itemsize


class ModelRunner(StepInputs, MultiStepRunner):
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str,
                 num_blocks: int, block_size: int, seed: int = 0, use_kernel: bool = True,
                 batch_invariant: bool = False, quantization: str | None = None,
                 kv_dtype: torch.dtype | None = None, tp: TensorParallel | None = None,
                 pp: PipelineParallel | None = None, cp: ContextParallel | None = None,
                 kv_layout: KVLayout | None = None, lora_slots: tuple[int, int] | None = None,
                 num_state_slots: int = 0, num_snapshots: int = 0):
        self.use_kernel = use_kernel
        # batch_invariant: every prompt token reads its context through the block tables (its K/V written first),
        # so its attention is the same computation however the prompt was chunked and whatever shares the step,
        # and the backend picks matmul kernels whose rows do not depend on the batch. Otherwise a prompt's first
        # chunk attends over its own K/V (SDPA; model/attention.py "fresh" spans).
        self.batch_invariant = batch_invariant
        # tensor parallelism: this rank builds its shard of the model (parallel/layout.py) and reads its slice of
        # each checkpoint tensor; its KV cache holds its KV heads
        if tp is not None:
            cfg, weights = tp.layout.shard_config(), ShardedCheckpoint(weights, tp.layout)
        self.pp = pp  # pipeline parallelism: this stage's layers only (and the embedding and LM head on stage 0)
        if pp is not None:
            cfg, weights = pp.stage.shard_config(cfg), StageCheckpoint(weights, pp.stage)
        self.cfg, self.dtype, self.device, self.block_size = cfg, dtype, torch.device(device), block_size
        # Chosen once: use_kernel=False is the plain-PyTorch reference, which runs no C++ op at all.
        self.backend = select_backend(self.device, use_kernels=use_kernel, batch_invariant=batch_invariant)
        # context parallelism: the whole model here, 1/C of each sequence's tokens and KV (parallel/context.py); a
        # step's metadata carries this rank's share, and the attention layers attend through it
        self.cp = cp
        # Built in `dtype` on the meta device, then allocated uninitialised where it runs: each parameter is
        # written once, in place, as `weights` (a lazy checkpoint.Checkpoint, or any mapping) is read tensor by tensor.
        with torch.device("meta"):
            model = model_class(cfg)(cfg, self.backend, dtype, linear_method(quantization), tp=tp,
                                     stage=pp.stage if pp is not None else None)
        allocate_parameters(model, self.device)
        model.load_hf_weights(weights)
        self.model = model.eval()
        self.model.init_rotary(self.device)  # float32 tables, cast per step
        # LoRA: (slots, rank) of adapter slots in every projection, before packing (engine/lora_pool.py)
        self.lora = LoRAPool(self.model, cfg, *lora_slots) if lora_slots is not None else None
        self.prepacked = self.backend.prepack(self.model)  # e.g. oneDNN layouts on CPU (model/backends/cpu.py)
        # context parallelism: block_size / C tokens per block here, and a spare block (parallel/context.py)
        shape = ((num_blocks + 1, cp.block_size) if cp is not None else (num_blocks, block_size)) + (
            cfg.num_kv_heads, cfg.head_dim)
        # one cache tensor pair per page slot; a hybrid layout (engine/kv_layout.py) gives several layers one slot,
        # each reading it through its own table; a pipeline stage's layers are uniform (no state layers split yet)
        self.kv_layout = (kv_layout if kv_layout is not None and (kv_layout.hybrid or kv_layout.state_layers)
                          else KVLayout.uniform(cfg.num_layers, block_size))
        assert self.kv_layout.num_layers == cfg.num_layers, "the KV layout is of another model"
        # kv_dtype: the model's dtype by default, or FP8 e4m3 (--kv-cache-dtype fp8; written clamped to +-448)
        self.cache = CacheTensors(self.kv_layout, shape, kv_dtype or dtype, self.device, num_state_slots,
                                  num_snapshots)
        self.kv_caches = self.cache.per_layer
        # multi-step decode (execute with num_steps > 1) runs the model here, in one process, whole, all of its
        # layers paged (the C++ decode loop keeps no recurrent state)
        self.multi_step = tp is None and pp is None and cp is None and not self.cache.has_state
        self.sampler = Sampler(self.backend)
        self.base_seeds: dict[str, int] = {}  # unseeded requests: a base seed drawn from the engine's seed
        self._seed_rng = random.Random(seed)
        self.calls = model_calls(tp, pp, cp)  # rank 0 of several: each call announced to the other ranks first

    def weight_format(self) -> str:
        """The matmul weights as served: the dtype, or the quantized format and the dtype it computes in."""
        # the first layer's first matmul (a mixture of experts' MLP or a convolution layer has no o_proj)
        first = next(m for m in self.model.layers[0].modules() if hasattr(m, "method"))
        fmt, dtype = first.method.name, str(self.dtype).removeprefix("torch.")
        return dtype if fmt == "dense" else f"{fmt} ({dtype} compute)"

    def weight_summary(self) -> str:
        """The matmul weight format and the bytes the model's weights hold, as the start-up log says them."""
        line = f"weights: {self.weight_format()}, {weight_bytes(self.model) / 2**20:.0f} MiB"
        if any(getattr(m, "gguf_type", None) is not None for m in self.model.linear_layers()):
            from tokenmill.quant.gguf_linear import kept_summary

            line += f" (matmuls: {kept_summary(self.model.linear_layers())})"
        return line

    # ---- per-request state -----------------------------------------------------------------------------
    def position_generator(self, request_id: str, seed: int | None, position: int, salt: int = 0) -> torch.Generator:
        """A generator for output position `position` of a request (see position_seed); `salt` gives another
        stream (a draft model's draws)."""
        if seed is None:
            seed = self.base_seeds.get(request_id)
            if seed is None:
                seed = self.base_seeds[request_id] = self._seed_rng.getrandbits(63)
        gen = torch.Generator(device=self.device)  # sampling runs where the logits are
        return gen.manual_seed(position_seed(seed ^ salt, position))

    def release(self, request_id: str) -> None:
        self.base_seeds.pop(request_id, None)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.lora is not None:
            self.lora.clear_runs()
        if out.num_steps > 1:
            return self._execute_run(out)
        if not self.cache.has_state:
            return self._execute_step(out)
        # State layers update their requests' slots in place (a step that fails leaves them half-updated: the core
        # then fails its requests, engine/core.py _execute); a request starting at position 0 starts from a zero
        # state, one starting at a prefix hit from the hit's snapshot, and a step ending at a block boundary may
        # leave a snapshot.
        reqs = [s.request for s in out.scheduled]
        self.cache.copy_states([(r.state_load, r.state_slot) for r in reqs if r.state_load is not None])
        self.cache.reset_states([r.state_slot for r in reqs if not r.num_computed_tokens])
        result = self._execute_step(out)
        self.cache.copy_states([(r.state_slot, r.state_save[0]) for r in reqs if r.state_save is not None])
        return result

    def _execute_step(self, out: SchedulerOutput) -> StepResult:
        # Paged tokens (decodes, later prefill chunks) first, then fresh prefills: see model/attention.py.
        if self.batch_invariant:
            paged, fresh = list(out.scheduled), []
        else:
            paged = [s for s in out.scheduled if s.request.num_computed_tokens > 0 or s.num_new_tokens == 1]
            fresh = [s for s in out.scheduled if s.request.num_computed_tokens == 0 and s.num_new_tokens > 1]
        if self.lora is not None:  # requests of one adapter side by side: one run of rows each (model/lora.py)
            paged, fresh = self.lora.prepare(paged, fresh)
        ordered = paged + fresh
        if self.pp is not None and self.pp.micro_batches > 1:
            # pipeline parallelism: the step in micro-batches (contiguous runs of its tokens, so the hidden states
            # come back in order), which the stages work on at once. Where every token reads its context through
            # the block tables a request's chunk may be cut too: its second part reads the first's KV, which each
            # stage wrote one micro-batch earlier.
            runs = micro_batches(ordered, self.pp.micro_batches, split_chunks=self.batch_invariant)
            in_paged = {id(s) for s in paged}
            batches = [self._inputs(run, sum(id(s) in in_paged for s, _, _ in run)) for run in runs]
            hidden = self.calls.forward(self.model, batches, self.kv_caches)
        else:
            hidden = self.calls.forward(self.model, [self._inputs([(s, 0, s.num_new_tokens) for s in ordered],
                                                                  len(paged))], self.kv_caches)
        last_rows, sampling = [], []
        row, scoring = 0, False
        for s in ordered:
            row += s.num_new_tokens
            scoring = scoring or s.request.params.prompt_logprobs is not None
            if s.samples_next_token:  # the last committed token's row, and one per draft token it verifies
                last_rows.extend(range(row - 1 - s.num_spec_tokens, row))
                sampling.append(s)
        prompt_logprobs = self._prompt_logprobs(hidden, ordered) if scoring else {}
        pooled = self._pooled(hidden, ordered) if any(s.request.pools for s in ordered) else {}
        if not sampling:
            return StepResult(prompt_logprobs=prompt_logprobs, pooled=pooled)
        every_row = len(last_rows) == hidden.shape[0] and last_rows[-1] == len(last_rows) - 1  # rows ascend
        logits = self.calls.logits(self.model, hidden if every_row else hidden[self._long(last_rows)])
        if out.grammar is not None:  # constrained requests: their rows' masks
            masks = out.grammar.bitmask([(s.request.request_id, s.request.spec_token_ids[:s.num_spec_tokens])
                                         for s in sampling])
            if masks is not None:
                logits = logits.float()
                out.grammar.apply(logits, *masks)
        rows = [r for s in sampling for r in self._sampling_rows(s)]
        try:
            results = self.sampler(logits, rows)
        except Exception:  # noqa: BLE001 - find the request(s) at fault: each alone; the others still get tokens
            result = self._sample_one_by_one(logits, rows, sampling)
        else:
            result, i = StepResult(), 0
            for s, mine in zip(sampling, _per_request(results, sampling)):
                rid, n = s.request.request_id, 1 + s.num_spec_tokens
                q = out.draft_probs.get(rid)
                # seeded requests keep the point-mass rule: their tokens are then the ones decoding without
                # speculation draws, whether or not (and however far) a step speculated
                if q is not None and n > 1 and not s.request.params.greedy and s.request.params.seed is None:
                    result.sampled[rid] = self._rejection_sample(s, q, logits[i:i + n], rows[i:i + n])
                else:
                    result.sampled[rid] = verify(s, mine)
                i += n
        result.prompt_logprobs = prompt_logprobs
        result.pooled = pooled
        return result

    @staticmethod
    def _pooled(hidden: torch.Tensor, ordered: list[ScheduledRequest]) -> dict[str, list[float]]:
        """Embedding requests' Request.pooled after this chunk: "mean" adds its rows to the sum so far, one row
        after another in float64 (a sequential scan from the previous sum: the same sum however the prompt was
        chunked or batched); "last" takes the last prompt token's row when the chunk holds it."""
        out, row = {}, 0
        for s in ordered:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            if req.params.pooling == "mean":
                rows = hidden[row:row + n].to(torch.float64)
                if start > 0 and req.pooled is not None:
                    rows = torch.cat([torch.tensor(req.pooled, dtype=torch.float64).unsqueeze(0), rows])
                out[req.request_id] = rows.cumsum(0)[-1].tolist()
            elif req.params.pooling == "last" and start + n >= req.num_prompt_tokens:
                out[req.request_id] = hidden[row + req.num_prompt_tokens - 1 - start].to(torch.float64).tolist()
            row += n
        return out

    def _step_row(self, req: Request, output: list[int]) -> SamplingRow:
        """The sampling row of a request's next output token after `output`."""
        p = req.params
        blocked = request_stop_ids(req) if len(output) < p.min_tokens else None
        gen = None if p.greedy else self.position_generator(req.request_id, p.seed, len(output))
        return SamplingRow(p, req.prompt_token_ids, output, gen, blocked)

    def _prompt_logprobs(self, hidden: torch.Tensor, ordered: list[ScheduledRequest]
                         ) -> dict[str, list[dict[int, float]]]:
        """For requests asking for prompt logprobs: the logprob of each prompt token from the row of the position
        before it, for the positions of this chunk not reported yet (a recompute after preemption repeats some)."""
        out, row = {}, 0
        for s in ordered:
            req, start = s.request, s.request.num_computed_tokens
            first = max(start, req.num_prompt_logprobs)
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)  # the last prompt row samples instead
            if req.params.prompt_logprobs is not None and first < end:
                targets = req.prompt_token_ids[first + 1:end + 1]
                out[req.request_id] = self._score(hidden[row + first - start:row + end - start], targets,
                                                  req.params.prompt_logprobs)
            row += s.num_new_tokens
        return out

    def _score(self, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[dict[int, float]]:
        """{target: logprob, then the top-n} per row, PROMPT_LOGPROB_ROWS rows of logits at a time."""
        out = []
        for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            chunk = targets[i:i + PROMPT_LOGPROB_ROWS]
            logprobs = self.calls.logits(self.model, hidden[i:i + len(chunk)]).float().log_softmax(dim=-1)
            picked = logprobs.gather(1, self._long(chunk).unsqueeze(1)).squeeze(1).tolist()
            rows = [{t: v} for t, v in zip(chunk, picked)]
            if top_n:
                vals, ids = logprobs.topk(top_n, dim=-1)
                for entry, row_ids, row_vals in zip(rows, ids.tolist(), vals.tolist()):
                    for t, v in zip(row_ids, row_vals):
                        entry.setdefault(t, v)
            out += rows
        return out

    def _rejection_sample(self, s: ScheduledRequest, q: torch.Tensor, logits: torch.Tensor,
                          rows: list[SamplingRow]) -> SampledTokens:
        """Drafts drawn from a draft model's q: engine/rejection.py, with fresh generators for the same positions."""
        d, req = s.num_spec_tokens, s.request
        p = self.sampler.probabilities(logits, rows)
        gens = [self.position_generator(req.request_id, req.params.seed, len(r.output_token_ids)) for r in rows]
        tokens = rejection_sample(p, q[:d], req.spec_token_ids[:d], gens)
        logprobs = None
        if req.params.logprobs is not None:
            raw = logits[:len(tokens)].float().log_softmax(dim=1)
            logprobs = [top_logprobs(raw[j], t, req.params.logprobs) for j, t in enumerate(tokens)]
        return SampledTokens(tokens, logprobs)

    def _sample_one_by_one(self, logits: torch.Tensor, rows: list[SamplingRow],
                           sampling: list[ScheduledRequest]) -> StepResult:
        result, i = StepResult(), 0
        for s in sampling:
            rid, n = s.request.request_id, 1 + s.num_spec_tokens
            try:
                result.sampled[rid] = verify(s, self.sampler(logits[i:i + n], rows[i:i + n]))
            except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                result.failed[rid] = f"sampling failed: {e}"
            i += n
        return result

    @torch.inference_mode()
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata]) -> torch.Tensor:
        """The hidden states of one batch of token ids, positions and metadata (e.g. `span_inputs`'), its K/V
        written to the cache: for callers that run the model beside the scheduler's steps (a draft model)."""
        return self.calls.forward(self.model, [inputs], self.kv_caches)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.calls.logits(self.model, hidden)

    def _sampling_rows(self, s: ScheduledRequest) -> list[SamplingRow]:
        """One row per output position this step samples: the next token, then one after each draft token (its
        output so far includes the drafts before it, for penalties and min_tokens)."""
        req = s.request
        return [self._step_row(req, req.output_token_ids + req.spec_token_ids[:j] if j else req.output_token_ids)
                for j in range(1 + s.num_spec_tokens)]


def _per_request(results: list, sampling: list[ScheduledRequest]) -> list[list]:
    """Split the sampler's flat results into each request's 1 + drafts rows."""
    out, i = [], 0
    for s in sampling:
        n = 1 + s.num_spec_tokens
        out.append(results[i:i + n])
        i += n
    return out


def verify(s: ScheduledRequest, sampled: list[tuple[int, dict[int, float] | None]]) -> SampledTokens:
    """Keep the drafts the target agrees with, then the target's own token. Each row was sampled as if there were
    no drafts (its own generator per position), so a draft is accepted exactly when it is the token the target
    draws there: for a proposer that offers one token (q a point mass) this is rejection sampling, accepting with
    probability p(draft) and otherwise drawing from p without the draft, i.e. max(0, p - q) renormalised; and
    the output is token for token what decoding without speculation gives."""
    drafts = s.request.spec_token_ids[:s.num_spec_tokens]
    accepted = 0
    while accepted < len(drafts) and sampled[accepted][0] == drafts[accepted]:
        accepted += 1
    kept = sampled[:accepted + 1]
    logprobs = [lp for _, lp in kept] if kept[0][1] is not None else None
    return SampledTokens([t for t, _ in kept], logprobs)
