"""Disaggregated prefill/decode at the engine core: a producer core computes the prompt and ships its KV, a consumer
core takes it and decodes. Greedy (and seeded) output must be token for token what one colocated core gives, with
chunked prefill, prefix caching on either side, n > 1 and aborts; both block pools whole afterwards
(check_idle_invariants), and the consumer computes only the token the KV did not cover. A claim needs the
producer's transfer_token, and loaded KV is shared through the prefix cache only within its request's cache salt."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.disagg.auth import transfer_token
from tokenmill.disagg.transfer import KVTransferParams
from tokenmill.engine import kv_transfer_hooks
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import AddRequest
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
SECRET = "core-transfer-test-secret-0123"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("disagg"), vocab_size=256)


def make_core(model, tmp_path, role: str | None, connector: str, *, chunk: int = 2048, prefix: bool = True,
              num_blocks: int | None = None):
    kv = ({"kv_connector": connector, "kv_role": role, "kv_port": 0, "shm_dir": str(tmp_path / "shm"),
           "kv_secret": SECRET} if role else None)
    return EngineCore(EngineConfig(model=str(model), dtype="float32", kv_transfer=kv,
                                   cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4, num_blocks=num_blocks,
                                                     enable_prefix_caching=prefix),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=chunk)))


class Pair:
    """A producer, a consumer and a colocated reference, on one connector."""

    def __init__(self, model, tmp_path, connector: str, **kw):
        self.producer = make_core(model, tmp_path, "kv_producer", connector, **kw)
        self.consumer = make_core(model, tmp_path, "kv_consumer", connector, **kw)
        self.colocated = make_core(model, tmp_path, None, connector, **kw)
        address = self.consumer.connector.address()
        self.host, self.port = address.rsplit(":", 1) if address else (None, None)
        self.port = int(self.port) if self.port else None

    def ship(self, tid: str) -> KVTransferParams:
        return KVTransferParams(tid, True, self.host, self.port)

    def close(self) -> None:
        for core in (self.producer, self.consumer, self.colocated):
            if core.connector is not None:
                core.connector.close()


@pytest.fixture(params=["shm", "tcp"])
def pair(request, model, tmp_path):
    p = Pair(model, tmp_path, request.param)
    yield p
    p.close()


def add(rid: str, prompt: list[int], params: SamplingParams = GREEDY, transfer: KVTransferParams | None = None,
        max_tokens: int | None = None, salt: str | None = None) -> AddRequest:
    return AddRequest(rid, prompt, params, max_tokens or params.max_tokens, frozenset(), time.monotonic(),
                      cache_salt=salt, kv_transfer=transfer)


def take(tid: str) -> KVTransferParams:
    """A consumer's claim, with the token the producer's answer carries."""
    return KVTransferParams(tid, False, transfer_token=transfer_token(SECRET.encode(), tid))


def run(core: EngineCore, *msgs: AddRequest, abort_after: dict[str, int] | None = None) -> dict[str, list]:
    """Step until idle; returns each sequence's outputs. `abort_after`: abort a sequence after that many steps."""
    for m in msgs:
        core.add_request(m)
    outs: dict[str, list] = {}
    steps = 0
    while core.has_unfinished:
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
        steps += 1
        for rid, n in (abort_after or {}).items():
            if steps == n:
                core.abort([rid])
    core.check_idle_invariants()
    return outs


def tokens(outs: dict[str, list], rid: str) -> list[int]:
    return [t for o in outs[rid] for t in o.new_token_ids]


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def disaggregated(pair: Pair, prompt: list[int], tid: str, params: SamplingParams = GREEDY,
                  salt: str | None = None) -> tuple[dict, dict]:
    produced = run(pair.producer, add("p-" + tid, prompt, PREFILL, pair.ship(tid)))
    return produced, run(pair.consumer, add("d-" + tid, prompt, params, take(tid), salt=salt))


@pytest.mark.parametrize("length", [5, 37, 64])
def test_greedy_output_is_the_colocated_output_and_only_the_last_token_is_computed(pair, length):
    prompt = prompt_of(length, length)
    ref = tokens(run(pair.colocated, add("r", prompt)), "r")
    computed = pair.consumer.scheduler.num_prefill_tokens_computed
    produced, decoded = disaggregated(pair, prompt, f"t{length}")
    result = produced[f"p-t{length}"][-1].kv_transfer
    assert result["status"] == "sent" and result["num_tokens"] == length
    assert result["num_bytes"] == length * pair.producer.connector.layout.token_bytes
    assert tokens(decoded, f"d-t{length}") == ref
    assert pair.consumer.scheduler.num_prefill_tokens_computed - computed == 1
    assert pair.consumer.connector.stats().loaded_tokens == length - 1


def test_the_loaded_kv_is_what_the_consumer_attends_to(pair, monkeypatch):
    """Zeroed KV in flight changes the answer: the consumer really reads what arrived (the test above has teeth)."""
    prompt = prompt_of(40, 1)
    ref = tokens(run(pair.colocated, add("r", prompt)), "r")
    real = kv_transfer_hooks.read_tokens
    monkeypatch.setattr(kv_transfer_hooks, "read_tokens", lambda *a: torch.zeros_like(real(*a)))
    _, decoded = disaggregated(pair, prompt, "zeroed")
    assert tokens(decoded, "d-zeroed") != ref


def test_chunked_prefill_ships_each_chunk_as_it_is_computed(model, tmp_path):
    pair = Pair(model, tmp_path, "tcp", chunk=16)
    try:
        prompt = prompt_of(100, 2)
        ref = tokens(run(pair.colocated, add("r", prompt)), "r")
        sends = []
        real = pair.producer.connector.send
        pair.producer.connector.send = lambda tid, start, kv: (sends.append((start, len(kv))), real(tid, start, kv))
        _, decoded = disaggregated(pair, prompt, "chunked")
        assert tokens(decoded, "d-chunked") == ref
        assert [s for s, _ in sends] == list(range(0, 100, 16)) and sum(n for _, n in sends) == 100
    finally:
        pair.close()


def test_prefix_caching_on_either_side(pair):
    shared = prompt_of(48, 3)
    first, second = shared + prompt_of(9, 4), shared + prompt_of(11, 5)
    ref = {i: tokens(run(pair.colocated, add(f"r{i}", p)), f"r{i}") for i, p in enumerate((first, second))}
    # the producer's second prompt hits its cache: the cached blocks are shipped all the same
    _, d0 = disaggregated(pair, first, "pc0", salt="tenant")
    hits = pair.producer.kv.prefix_stats.hits
    produced, d1 = disaggregated(pair, second, "pc1", salt="tenant")
    assert pair.producer.kv.prefix_stats.hits - hits >= 48
    assert produced["p-pc1"][-1].kv_transfer["num_tokens"] == len(second)
    assert tokens(d0, "d-pc0") == ref[0] and tokens(d1, "d-pc1") == ref[1]
    # the consumer's cache holds the shared prefix now, for this tenant: a third request loads only what follows it
    third = shared + prompt_of(13, 6)
    ref3 = tokens(run(pair.colocated, add("r3", third)), "r3")
    loaded = pair.consumer.connector.stats().loaded_tokens
    _, d2 = disaggregated(pair, third, "pc2", salt="tenant")
    assert tokens(d2, "d-pc2") == ref3
    assert pair.consumer.connector.stats().loaded_tokens - loaded == len(third) - 1 - 48


def test_n_samples_share_one_transfer_and_match_colocated_seeded_sampling(pair):
    prompt = prompt_of(30, 7)
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(3)]
    ref = run(pair.colocated, *(add(f"r#{i}", prompt, p) for i, p in enumerate(seeded)))
    run(pair.producer, add("p", prompt, PREFILL, pair.ship("n3")))
    computed = pair.consumer.scheduler.num_prefill_tokens_computed
    got = run(pair.consumer, *(add(f"d#{i}", prompt, p, take("n3")) for i, p in enumerate(seeded)))
    for i in range(3):
        assert tokens(got, f"d#{i}") == tokens(ref, f"r#{i}")
    assert pair.consumer.scheduler.num_prefill_tokens_computed - computed == 3  # one token each


def test_a_consumer_request_whose_kv_never_came_computes_its_prompt(pair):
    prompt = prompt_of(25, 8)
    ref = tokens(run(pair.colocated, add("r", prompt)), "r")
    computed = pair.consumer.scheduler.num_prefill_tokens_computed
    got = run(pair.consumer, add("d", prompt, GREEDY, take("never-sent")))
    assert tokens(got, "d") == ref
    assert pair.consumer.scheduler.num_prefill_tokens_computed - computed == len(prompt)
    assert pair.consumer.connector.stats().missed_claims == 1


def test_kv_of_another_prompt_is_used_only_as_far_as_the_prompts_agree(pair):
    shipped = prompt_of(40, 9)
    other = shipped[:20] + prompt_of(15, 10)
    ref = tokens(run(pair.colocated, add("r", other)), "r")
    run(pair.producer, add("p", shipped, PREFILL, pair.ship("mixed")))
    got = run(pair.consumer, add("d", other, GREEDY, take("mixed")))
    assert tokens(got, "d") == ref


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_aborting_the_producer_mid_prompt_ships_nothing_and_frees_everything(model, tmp_path, connector):
    pair = Pair(model, tmp_path, connector, chunk=8)
    shm = tmp_path / "shm"

    def left() -> bool:  # the sender thread carries the abort out after the step: wait for it
        return bool(pair.consumer.connector.buffered_bytes() or (connector == "shm" and any(shm.iterdir())))
    try:
        prompt = prompt_of(60, 11)
        out = run(pair.producer, add("p", prompt, PREFILL, pair.ship("aborted")), abort_after={"p": 2})
        assert "p" not in out or all(o.kv_transfer is None for o in out["p"])
        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not left()  # no buffer (tcp), no partial file (shm) left
        assert pair.consumer.connector.claim("aborted") is None
    finally:
        pair.close()


def test_aborting_a_consumer_request_before_it_loads_drops_the_claimed_kv(pair):
    prompt = prompt_of(30, 12)
    run(pair.producer, add("p", prompt, PREFILL, pair.ship("gone")))
    pair.consumer.add_request(add("d", prompt, GREEDY, take("gone")))
    pair.consumer.abort(["d"])
    assert not pair.consumer.has_unfinished
    pair.consumer.check_idle_invariants()  # no claimed transfer outlives its request


def test_a_producer_sequence_that_keeps_decoding_reports_its_transfer_when_it_ends(pair):
    prompt = prompt_of(20, 13)
    out = run(pair.producer, add("p", prompt, GREEDY, pair.ship("long")))
    assert len(tokens(out, "p")) == GREEDY.max_tokens
    assert out["p"][-1].kv_transfer["status"] == "sent"
    assert all(o.kv_transfer is None for o in out["p"][:-1])


def test_a_consumer_request_wanting_prompt_logprobs_computes_its_prompt_and_drops_the_kv(pair):
    prompt = prompt_of(20, 14)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    ref = run(pair.colocated, add("r", prompt, params))
    run(pair.producer, add("p", prompt, PREFILL, pair.ship("lp")))
    got = run(pair.consumer, add("d", prompt, params, take("lp")))
    assert tokens(got, "d") == tokens(ref, "r")
    assert [o.new_prompt_logprobs for o in got["d"]] == [o.new_prompt_logprobs for o in ref["r"]]
    assert pair.consumer.connector.stats().buffered_bytes == 0  # claimed and dropped, not left to expire


def test_a_consumer_short_of_blocks_preempts_and_recomputes_to_the_same_output(model, tmp_path):
    """Three sequences loaded from transfers outgrow a 40-block pool while decoding: the one preempted is
    recomputed from its prompt (its arrived KV is not kept), and every output is still the colocated one."""
    pair = Pair(model, tmp_path, "tcp", num_blocks=40, prefix=False)
    try:
        prompts = [prompt_of(30, 20 + i) for i in range(3)]
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        ref = run(pair.colocated, *(add(f"r{i}", p, params) for i, p in enumerate(prompts)))
        for i, p in enumerate(prompts):
            run(pair.producer, add(f"p{i}", p, PREFILL, pair.ship(f"pre{i}")))
        got = run(pair.consumer, *(add(f"d{i}", p, params, take(f"pre{i}"))
                                   for i, p in enumerate(prompts)))
        assert pair.consumer.scheduler.num_preemptions > 0
        for i in range(3):
            assert tokens(got, f"d{i}") == tokens(ref, f"r{i}")
    finally:
        pair.close()


def test_a_claim_without_the_producers_token_takes_nothing(pair):
    """A request that cannot show the transfer's token computes its prompt; the KV stays for the one that can."""
    prompt = prompt_of(30, 30)
    ref = tokens(run(pair.colocated, add("r", prompt)), "r")
    run(pair.producer, add("p", prompt, PREFILL, pair.ship("owned")))
    computed = pair.consumer.scheduler.num_prefill_tokens_computed
    for i, token in enumerate((None, transfer_token(SECRET.encode(), "other"), "0" * 64)):
        claim = KVTransferParams("owned", False, transfer_token=token)
        got = run(pair.consumer, add(f"thief{i}", prompt, GREEDY, claim, salt=f"thief{i}"))  # no cache hits
        assert tokens(got, f"thief{i}") == ref
    assert pair.consumer.scheduler.num_prefill_tokens_computed - computed == 3 * len(prompt)
    assert pair.consumer.connector.stats().refused_claims == 3
    computed = pair.consumer.scheduler.num_prefill_tokens_computed
    got = run(pair.consumer, add("owner", prompt, GREEDY, take("owned"), salt="owner"))
    assert tokens(got, "owner") == ref
    assert pair.consumer.scheduler.num_prefill_tokens_computed - computed == 1


def test_loaded_kv_joins_the_prefix_cache_only_under_its_cache_salt(pair):
    """Pushed KV is whatever the producer request made it: it must not answer another tenant's prefix lookup. Without
    a salt it is shared with no one; with one, only with requests of that salt."""
    consumer = pair.consumer

    def hits_of(rid: str, prompt: list[int], salt: str | None = None, transfer: KVTransferParams | None = None) -> int:
        before = consumer.kv.prefix_stats.hits
        got = run(consumer, add(rid, prompt, GREEDY, transfer, salt=salt))
        assert tokens(got, rid) == tokens(run(pair.colocated, add("r", prompt)), "r")
        return consumer.kv.prefix_stats.hits - before

    unsalted, salted = prompt_of(40, 31), prompt_of(40, 32)
    run(pair.producer, add("p1", unsalted, PREFILL, pair.ship("unsalted")))
    assert hits_of("d1", unsalted, transfer=take("unsalted")) == 0
    assert hits_of("plain", unsalted) == 0  # its loaded blocks were never cached
    run(pair.producer, add("p2", salted, PREFILL, pair.ship("salted")))
    assert hits_of("d2", salted, "tenant-a", take("salted")) == 0
    assert hits_of("b", salted, "tenant-b") == 0 and hits_of("none", salted) == 0
    assert hits_of("a", salted, "tenant-a") == 36  # every whole block but the one holding the last token
    # a request that loads KV without a salt still takes what this engine computed and cached itself
    run(pair.producer, add("p3", unsalted, PREFILL, pair.ship("again")))
    loaded = consumer.connector.stats().loaded_tokens
    assert hits_of("d3", unsalted, transfer=take("again")) == 36
    assert consumer.connector.stats().loaded_tokens - loaded == len(unsalted) - 1 - 36
