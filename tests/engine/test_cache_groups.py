"""Cache groups: a model whose layers keep three kinds of state (full attention, a sliding window, a recurrent state
per request: tests/models/toy_hybrid.py) served through one cache manager and one memory budget."""

from __future__ import annotations

import time

import pytest
import torch

from tests.models.toy_hybrid import CONV, load_reference, make_toy_hybrid
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.engine.cache_tensors import CacheTensors
from tokenmill.engine.core import EngineCore
from tokenmill.engine.kv_layout import KVLayout
from tokenmill.engine.messages import AddRequest
from tokenmill.errors import ConfigError
from tokenmill.model.layer_cache import LayerCache
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import SamplingParams

HIDDEN = 32
STATE_BYTES = 2 * ((CONV - 1) * HIDDEN + HIDDEN) * 4  # two state layers, float32


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_hybrid(tmp_path_factory.mktemp("toy") / "toy-hybrid", hidden_size=HIDDEN)


def make_core(path, *, memory: int = 1 << 20, num_blocks: int | None = None, seqs: int = 8, chunk: int = 512,
              prefix_caching: bool = True, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), dtype="float32",
                                   cache=CacheConfig(kv_cache_memory=memory, block_size=4, num_blocks=num_blocks,
                                                     enable_prefix_caching=prefix_caching),
                                   scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk), **kw))


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 8) -> None:
    core.add_request(AddRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), max_tokens,
                                frozenset(), time.monotonic()))


def drain(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_unfinished:
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 61 + 1 for j in range(5 + 6 * i)] for i in range(6)}
SHORT = {f"s{i}": [(5 * i + 2 * j) % 61 + 1 for j in range(4 + i)] for i in range(6)}  # short prompts, long answers


def test_the_layout_has_three_groups_and_the_state_is_paid_from_the_budget_first(toy):
    memory = 1 << 20
    core = make_core(toy, memory=memory, seqs=8)
    info, layout = core.cache_info, core.cache_info.layout
    assert [c.kind for c in layout.caches] == ["attention", "window", "state"] * 2
    assert layout.hybrid and layout.num_paged_layers == 4 and layout.state_layers == [2, 5]
    assert info.state_slots == 8 and info.state_bytes == STATE_BYTES
    assert info.prefix_caching and info.state_snapshots == 4 * 8  # snapshots of states a cached prefix starts from
    rows = 8 + 32
    assert info.num_blocks == (memory - rows * STATE_BYTES) // info.page_bytes  # pages get what the state left
    assert memory - info.page_bytes < info.total_bytes == info.num_blocks * info.page_bytes + rows * STATE_BYTES
    assert info.total_bytes <= memory
    summary = core.startup_summary()
    assert "2 attention, 2 window (8 tokens), 2 state layers" in summary and "recurrent state: 8 slots" in summary
    assert "prefix caching on, 32 state snapshots" in summary
    # the runner holds a slot per state layer and request, then the snapshots, beside the paged layers' pages
    conv_state, hidden_state = core.runner.kv_caches[2]
    assert conv_state.shape == (rows, CONV - 1, HIDDEN) and hidden_state.shape == (rows, HIDDEN)
    assert len(core.runner.kv_caches[0]) == 2 and core.runner.kv_caches[0][0].shape[0] == info.num_blocks


def test_snapshots_take_at_most_a_quarter_of_what_the_slots_leave(toy):
    core = make_core(toy, memory=(8 + 40) * STATE_BYTES, seqs=8)
    assert core.cache_info.state_snapshots == 10 and core.kv.snapshots.num_rows == 10
    assert core.cache_info.num_blocks == (30 * STATE_BYTES) // core.cache_info.page_bytes
    no_room = make_core(toy, memory=(8 + 3) * STATE_BYTES, num_blocks=20, seqs=8)  # a quarter of 3: no snapshot
    assert not no_room.cache_info.prefix_caching and no_room.kv.tree is None
    assert "prefix caching off (no room for state snapshots: raise --kv-cache-memory)" in no_room.startup_summary()


def test_a_budget_the_state_uses_up_is_refused_naming_the_flags(toy):
    with pytest.raises(ConfigError, match="recurrent-state slots.*--max-num-seqs"):
        make_core(toy, memory=64 * STATE_BYTES, seqs=64)


@pytest.mark.parametrize("kw, flag", [
    ({"speculative": SpeculativeConfig(method="ngram", num_speculative_tokens=2)}, "--speculative-config"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
    ({"enable_lora": True}, "--enable-lora"),  # adapters reach attention projections a state layer lacks
])
def test_what_cannot_carry_recurrent_state_yet_is_refused_at_start(toy, kw, flag):
    with pytest.raises(ConfigError, match=flag):
        make_core(toy, **kw)


def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The reference's greedy tokens and, per token, the gap between its best two logits."""
    tokens, gaps = list(prompt), []
    for _ in range(n):
        top = model.reference_logits(tokens)[-1].topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
    return tokens[len(prompt):], gaps


def assert_greedy_matches(got: list[int], want: list[int], gaps: list[float]) -> None:
    """Token for token up to a near tie (after which the two may part)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert gaps[i] < 1e-3, f"token {i}: {a} vs the reference's {b}, a gap of {gaps[i]:.4f}"
            return
    assert len(got) == len(want)


@pytest.mark.parametrize("prompts, chunk, num_blocks, max_tokens",
                         [(PROMPTS, 512, None, 8), (PROMPTS, 4, None, 8), (SHORT, 6, 20, 30)],
                         ids=["whole", "chunked", "preempted"])
def test_batched_chunked_and_preempted_output_is_the_whole_sequence_reference(toy, prompts, chunk, num_blocks,
                                                                              max_tokens):
    """Every request fits the pool alone (as admission at the edge ensures); together they outgrow it."""
    core = make_core(toy, chunk=chunk, num_blocks=num_blocks)
    for rid, prompt in prompts.items():
        add(core, rid, prompt, max_tokens)
    out = drain(core)
    if num_blocks is not None:
        assert core.scheduler.num_preemptions > 0, "the pool was meant to be short"
    core.check_idle_invariants()
    model = load_reference(toy)
    for rid, prompt in prompts.items():
        assert_greedy_matches(out[rid], *greedy_reference(model, prompt, max_tokens))


def test_a_slot_is_held_exactly_while_a_request_runs_and_comes_back_on_finish_abort_and_preemption(toy):
    core = make_core(toy, num_blocks=20, chunk=6, seqs=8)
    slots = core.kv.state
    for rid, prompt in SHORT.items():
        add(core, rid, prompt, 30)
    aborted = preempted = False
    while core.has_unfinished:
        core.step()
        requests = list(core.scheduler.requests.values())
        running = [r for r in requests if r.status == RequestStatus.RUNNING]
        assert all(r.state_slot is None for r in requests if r.status != RequestStatus.RUNNING)
        assert len({r.state_slot for r in running} - {None}) == len(running) == 8 - slots.num_free
        preempted = preempted or any(r.status == RequestStatus.PREEMPTED for r in requests)
        if preempted and not aborted and len(running) >= 2:  # a preemption seen: now an abort
            core.abort([running[1].request_id])
            aborted = True
            assert slots.num_free == 8 - (len(running) - 1)
    assert aborted and preempted
    core.check_idle_invariants()
    assert slots.num_free == 8


def test_a_reset_zeroes_its_slots_only():
    caches = [LayerCache.attention(), LayerCache.state((2, 3), (3,))]
    cache = CacheTensors(KVLayout.uniform(2, 4, caches), (5, 4, 1, 8), torch.float32, torch.device("cpu"), 4)
    conv, hidden = cache.per_layer[1]
    conv.normal_(), hidden.normal_()
    before = [conv.clone(), hidden.clone()]
    cache.reset_states([2])
    assert not conv[2].any() and not hidden[2].any()
    assert torch.equal(conv[1], before[0][1]) and torch.equal(hidden[3], before[1][3])


def test_a_failed_step_fails_its_requests_and_leaks_nothing(toy, monkeypatch):
    """A step that raises has updated its requests' recurrent state in place, part way: rerunning them would start
    from it, so each request of the step fails with the error; later requests run as usual, and every slot, page and
    snapshot comes back."""
    core = make_core(toy)
    model, forward = core.runner.model, core.runner.model.forward

    def faulty(input_ids, *args, **kwargs):
        if bool((input_ids == 60).any()):
            raise RuntimeError("kernel fault")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", faulty)
    add(core, "bad", [5, 60, 7])
    add(core, "beside", [5, 6, 7, 8])
    errors = {}
    while core.has_unfinished:
        for o in core.step().outputs:
            if o.error:
                errors[o.request_id] = o.error
    assert set(errors) == {"bad", "beside"} and all("kernel fault" in e for e in errors.values())
    core.check_idle_invariants()
    add(core, "after", PROMPTS["r1"])
    assert_greedy_matches(drain(core)["after"], *greedy_reference(load_reference(toy), PROMPTS["r1"], 8))
    core.check_idle_invariants()
