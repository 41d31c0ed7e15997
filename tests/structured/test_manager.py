"""The engine side of structured output (tokenmill/structured/manager.py) on SmolLM2's tokenizer: matchers built
off the step loop (submit / ready / discard, failures and time-outs), the bitmask of a step's sampling rows (only
constrained rows, drafts up to the first the grammar forbids, the matcher rolled back), `advance` and
`apply_bitmask`. Builds run on a small pool: a slow grammar (tests/structured/grammars.py) leaves the other
builder to simple ones, requests sharing a grammar share its build, and a grammar built or refused before is
answered without queueing."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.models.tiny import EOS_ID, SMOLLM2_VOCAB, smollm2_tokenizer
from tests.structured.grammars import slow_grammar, slow_schema
from tokenmill.errors import ServerBusy
from tokenmill.structured.backend import GrammarCache, MatcherFactory, grammar_text
from tokenmill.structured.manager import StructuredOutputs, apply_bitmask
from tokenmill.structured_params import StructuredOutputsParams

WORDS = (SMOLLM2_VOCAB + 31) // 32
ALL = -1  # an int32 word with every bit set
# digit, letter, digit: each position allows a different set, so a row's mask tells where the grammar stands
DLD = r"[0-9][a-z][0-9]"


def tid(text: str) -> int:
    """The single token id of `text` in SmolLM2's vocabulary."""
    ids = smollm2_tokenizer().encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def request(rid: str, **constraint) -> SimpleNamespace:
    """What the manager reads of a request: its id and params.structured_outputs."""
    return SimpleNamespace(request_id=rid, params=SimpleNamespace(structured_outputs=StructuredOutputsParams(
        **constraint)))


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    """Token ids whose bit is set in `row`."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()).flatten().tolist())


def ready_all(so: StructuredOutputs, n: int) -> tuple[list, list]:
    """Wait until n requests left the pending set."""
    ok, failed = [], []
    deadline = time.monotonic() + 30
    while len(ok) + len(failed) < n:
        assert time.monotonic() < deadline, "matchers not built"
        a, b = so.ready(0.5)
        ok += a
        failed += b
    return ok, failed


@pytest.fixture
def so():
    manager = StructuredOutputs(SMOLLM2_VOCAB, smollm2_tokenizer)
    yield manager
    manager.close()


def constrained(so: StructuredOutputs, *requests: SimpleNamespace) -> None:
    for r in requests:
        so.submit(r, None)
    ok, failed = ready_all(so, len(requests))
    assert not failed
    assert {r.request_id for r in ok} == {r.request_id for r in requests}


# ---- waiting for a matcher ---------------------------------------------------------------------------------------


def test_ready_hands_over_built_matchers(so: StructuredOutputs) -> None:
    r = request("a", regex=DLD)
    so.submit(r, None)
    assert so.num_pending == 1 and "a" not in so and len(so) == 0
    ok, failed = ready_all(so, 1)
    assert ok == [r] and not failed
    assert so.num_pending == 0 and "a" in so and len(so) == 1
    so.release("a")
    assert "a" not in so and len(so) == 0


def test_a_request_failing_to_build_is_reported(so: StructuredOutputs) -> None:
    so.submit(request("bad", regex="(ab"), None)  # checked here: it came in-process without grammar text
    so.submit(request("good", choice=["x"]), None)
    ok, failed = ready_all(so, 2)
    assert [r.request_id for r in ok] == ["good"]
    (r, why), = failed
    assert r.request_id == "bad"
    assert why.startswith("structured output: ") and "regex" in why
    assert "bad" not in so and so.num_pending == 0


def test_a_failing_grammar_text_is_reported(so: StructuredOutputs) -> None:
    so.submit(request("x", regex="a"), "start: nowhere")
    _, failed = ready_all(so, 1)
    assert failed[0][0].request_id == "x" and "nowhere" in failed[0][1]


def test_discard_of_a_waiting_request_leaves_nothing(so: StructuredOutputs, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = StructuredOutputs._build

    def slow(self, spec, grammar):
        gate.wait(10)
        return real(self, spec, grammar)

    monkeypatch.setattr(StructuredOutputs, "_build", slow)
    so.submit(request("gone", regex=DLD), None)
    assert so.discard("gone") is True
    assert so.num_pending == 0
    gate.set()
    time.sleep(0.2)
    assert so.ready(0.2) == ([], [])
    assert "gone" not in so and len(so) == 0
    assert so.discard("gone") is False


def test_a_build_past_the_time_limit_fails_as_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its limit a request fails as ServerBusy (HTTP 503 with Retry-After: the server was too busy to build
    its grammar in time), not as an error of the request."""
    gate = threading.Event()
    so = StructuredOutputs(SMOLLM2_VOCAB, smollm2_tokenizer, timeout_s=0.05)
    so._matcher_factory()  # the tables loaded: the limit counts from here
    monkeypatch.setattr(StructuredOutputs, "_build", lambda self, spec, grammar: gate.wait(10))
    try:
        so.submit(request("slow", regex=DLD), None)
        time.sleep(0.1)
        ok, failed = so.ready()
        assert not ok
        (r, why), = failed
        assert r.request_id == "slow" and isinstance(why, ServerBusy) and why.retry_after >= 1
        assert str(why) == ("structured output: the grammar was not built within 0.05 s on this busy server; retry, "
                            "or simplify it")
        assert so.num_pending == 0 and "slow" not in so
    finally:
        gate.set()
        so.close()


def test_loading_the_tables_counts_against_no_request_and_json_object_comes_built() -> None:
    """The tokenizer's tables load at the first constrained request; a busy CPU slowing that load (here a load
    longer than the limit) fails no request, and json_object's grammar is built with them: later requests for it
    are answered from the built template."""
    def slow_tokenizer():
        time.sleep(0.6)
        return smollm2_tokenizer()

    so = StructuredOutputs(SMOLLM2_VOCAB, slow_tokenizer, timeout_s=0.2)
    try:
        so.submit(request("first", json_object=True), None)
        ok, failed = ready_all(so, 1)
        assert [r.request_id for r in ok] == ["first"] and not failed
        grammar = grammar_text(StructuredOutputsParams(json_object=True))
        assert so._known(grammar) is not None  # built with the tables, kept
    finally:
        so.close()


def test_common_grammars_build_under_load() -> None:
    """Many json_object requests at once while other threads keep both cores busy (a serving engine's matmuls):
    every one gets its matcher, none fails its time limit."""
    stop = threading.Event()

    def busy() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)

    load = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for t in load:
        t.start()
    so = StructuredOutputs(SMOLLM2_VOCAB, smollm2_tokenizer, timeout_s=2.0)
    try:
        grammar = GrammarCache().check(StructuredOutputsParams(json_object=True))
        for i in range(8):  # half as the API process sends them (checked text), half in-process
            so.submit(request(f"r{i}", json_object=True), grammar if i % 2 else None)
        ok, failed = ready_all(so, 8)
        assert sorted(r.request_id for r in ok) == sorted(f"r{i}" for i in range(8)) and not failed
    finally:
        stop.set()
        for t in load:
            t.join()
        so.close()


def ready_until(so: StructuredOutputs, rid: str) -> tuple[list, list]:
    """Wait until request `rid` left the pending set; every request that left meanwhile."""
    ok, failed = [], []
    deadline = time.monotonic() + 30
    while rid not in {r.request_id for r in ok} | {r.request_id for r, _ in failed}:
        assert time.monotonic() < deadline, f"{rid}'s matcher not built"
        a, b = so.ready(0.05)
        ok += a
        failed += b
    return ok, failed


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The grammar text of every matcher build started (templates reused are not builds)."""
    grammars: list[str] = []
    real = MatcherFactory.matcher

    def matcher(self, grammar: str):
        if self.cached(grammar) is None:
            grammars.append(grammar)
        return real(self, grammar)

    monkeypatch.setattr(MatcherFactory, "matcher", matcher)
    return grammars


def test_a_slow_grammar_does_not_hold_up_a_simple_one(so: StructuredOutputs) -> None:
    """The slow build (seconds) takes one builder; the simple request behind it takes the other."""
    constrained(so, request("warm", regex="[0-9]"))  # the tokenizer is loaded
    so.submit(request("slow", json=slow_schema("m")), slow_grammar("m"))
    so.submit(request("simple", regex=DLD), None)
    ok, failed = ready_until(so, "simple")
    assert [r.request_id for r in ok] == ["simple"] and not failed
    assert so.num_pending == 1  # the slow one is still building
    _, failed = ready_all(so, 1)
    (r, why), = failed
    assert r.request_id == "slow" and str(why).startswith("structured output: ") and "<backtrace>" not in str(why)
    assert so.num_pending == 0 and "slow" not in so and "simple" in so


def test_a_build_past_the_limit_fails_and_builds_waiting_behind_it_never_start(built: list[str]) -> None:
    so = StructuredOutputs(SMOLLM2_VOCAB, smollm2_tokenizer, workers=1)
    try:
        constrained(so, request("warm", regex="[0-9]"))  # the tokenizer is loaded, under the default limit
        so.timeout_s = 0.5
        so.submit(request("slow1", json=slow_schema("b1")), slow_grammar("b1"))
        so.submit(request("slow2", json=slow_schema("b2")), slow_grammar("b2"))
        ok, failed = ready_all(so, 2)
        assert not ok
        why = "structured output: the grammar was not built within 0.5 s on this busy server; retry, or simplify it"
        assert sorted((r.request_id, str(w)) for r, w in failed) == [("slow1", why), ("slow2", why)]
        assert slow_grammar("b2") not in built  # cancelled before it ran: slow1's build held the only builder
        assert so.num_pending == 0 and len(so) == 1
    finally:
        so.close()


def test_requests_with_one_grammar_share_one_build(so: StructuredOutputs, built: list[str]) -> None:
    grammar = GrammarCache().check(StructuredOutputsParams(regex=DLD))
    for rid in ("a", "b", "c"):
        so.submit(request(rid, regex=DLD), grammar)
    assert so.discard("b")  # one leaving does not cancel the build the others wait for
    ok, failed = ready_all(so, 2)
    assert sorted(r.request_id for r in ok) == ["a", "c"] and not failed
    assert built.count(grammar) == 1  # beside the common grammars built with the tables
    assert so.advance("a", [tid("7")]) is None  # each has its own matcher: "c" is still at the start
    bitmask, rows = so.bitmask([("a", []), ("c", [])])
    assert rows == [0, 1]
    assert tid("x") in allowed(bitmask, 0) and tid("x") not in allowed(bitmask, 1)
    assert tid("7") in allowed(bitmask, 1) and tid("7") not in allowed(bitmask, 0)


def test_a_grammar_built_or_refused_before_skips_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    so = StructuredOutputs(SMOLLM2_VOCAB, smollm2_tokenizer, workers=1)
    known = GrammarCache().check(StructuredOutputsParams(regex=DLD))
    refused = "start: nowhere"
    blocked = GrammarCache().check(StructuredOutputsParams(regex="[x-z]+"))
    gate = threading.Event()
    real = MatcherFactory.matcher

    def matcher(self, grammar: str):
        if grammar == blocked:
            gate.wait(10)
        return real(self, grammar)

    monkeypatch.setattr(MatcherFactory, "matcher", matcher)
    try:
        constrained(so, request("known", regex=DLD))
        so.submit(request("refused", regex="a"), refused)
        assert len(ready_all(so, 1)[1]) == 1
        so.submit(request("blocked", regex="[x-z]+"), blocked)  # holds the only builder
        so.submit(request("known2", regex=DLD), known)
        so.submit(request("refused2", regex="a"), refused)
        ok, failed = so.ready()
        assert [r.request_id for r in ok] == ["known2"]
        assert [r.request_id for r, _ in failed] == ["refused2"] and "nowhere" in failed[0][1]
        assert so.num_pending == 1
    finally:
        gate.set()
        so.close()


# ---- the bitmask ---------------------------------------------------------------------------------------------


def test_no_mask_without_constrained_rows(so: StructuredOutputs) -> None:
    assert so.bitmask([("free", []), ("other", [5, 6])]) is None
    constrained(so, request("c", regex=DLD))
    assert so.bitmask([("free", []), ("other", [5, 6])]) is None  # c is not in this step


def test_only_constrained_rows_are_masked(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    bitmask, rows = so.bitmask([("free", []), ("c", []), ("free2", [])])
    assert bitmask.shape == (3, WORDS) and bitmask.dtype == torch.int32
    assert rows == [1]
    assert (bitmask[0] == ALL).all() and (bitmask[2] == ALL).all()
    digits = {tid(str(d)) for d in range(10)}
    assert allowed(bitmask, 1) == digits  # SmolLM2 writes one digit per token
    assert EOS_ID not in allowed(bitmask, 1)


def test_drafts_mask_each_row_as_the_grammar_stands(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    d, x = tid("7"), tid("x")
    bitmask, rows = so.bitmask([("free", [d, d]), ("c", [d, x, d])])
    assert bitmask.shape == (3 + 4, WORDS)
    assert rows == [3, 4, 5, 6]
    assert (bitmask[:3] == ALL).all()  # the unconstrained request's rows, drafts included
    assert d in allowed(bitmask, 3) and x not in allowed(bitmask, 3)  # a digit
    assert x in allowed(bitmask, 4) and d not in allowed(bitmask, 4)  # then a letter
    assert d in allowed(bitmask, 5) and x not in allowed(bitmask, 5)  # a digit
    assert allowed(bitmask, 6) == {EOS_ID}  # then the end


def test_rows_after_the_first_forbidden_draft_are_not_masked(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    d, x = tid("7"), tid("x")
    bitmask, rows = so.bitmask([("c", [d, d, x])])  # the second draft is forbidden (a letter is due)
    assert rows == [0, 1]
    assert x in allowed(bitmask, 1) and d not in allowed(bitmask, 1)  # row 1 cannot pick the forbidden draft
    assert (bitmask[2] == ALL).all() and (bitmask[3] == ALL).all()
    bitmask, rows = so.bitmask([("c", [x, d])])  # the first draft is forbidden: only the first row
    assert rows == [0]
    assert (bitmask[1:] == ALL).all()


def test_bitmask_leaves_the_matcher_where_it_was(so: StructuredOutputs) -> None:
    """Drafts are consumed to fill their rows, then rolled back: the matcher stands at the committed tokens."""
    constrained(so, request("c", regex=DLD))
    d, x = tid("7"), tid("x")
    before, _ = so.bitmask([("c", [])])
    so.bitmask([("c", [d, x, d])])
    so.bitmask([("c", [d, d])])
    after, _ = so.bitmask([("c", [])])
    assert torch.equal(before, after)
    assert so.advance("c", [d]) is None  # the first token is still due: a digit is accepted...
    mask, _ = so.bitmask([("c", [])])
    assert x in allowed(mask, 0) and d not in allowed(mask, 0)  # ...and then a letter


def test_unconstrained_rows_stay_all_ones_with_two_constrained_requests(so: StructuredOutputs) -> None:
    constrained(so, request("a", regex=DLD), request("b", choice=["yes", "no"]))
    bitmask, rows = so.bitmask([("a", []), ("free", [tid("7")]), ("b", [])])
    assert rows == [0, 3]
    assert (bitmask[1:3] == ALL).all()
    yes_no = {smollm2_tokenizer().encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}
    assert yes_no <= allowed(bitmask, 3)
    assert tid("7") not in allowed(bitmask, 3)


# ---- advance -----------------------------------------------------------------------------------------------------


def test_advance_goes_on_then_stops(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    d, x = tid("7"), tid("x")
    assert so.advance("c", [d]) is None
    assert so.advance("c", [x, d]) == "stopped"  # several tokens a step (accepted drafts)
    mask, _ = so.bitmask([("c", [])])
    assert allowed(mask, 0) == {EOS_ID}


def test_advance_refused_token_is_an_error(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    assert so.advance("c", [tid("x")]) == "error"


def test_advance_of_an_unconstrained_request_is_none(so: StructuredOutputs) -> None:
    assert so.advance("free", [tid("x")]) is None


def test_open_ended_grammar_is_not_stopped_while_it_may_go_on(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex="[0-9]+"))
    assert so.advance("c", [tid("7")]) is None
    mask, _ = so.bitmask([("c", [])])
    assert {EOS_ID, tid("7")} <= allowed(mask, 0)


# ---- apply_bitmask ---------------------------------------------------------------------------------------------


def test_apply_bitmask_sets_exactly_the_forbidden_tokens_to_minus_infinity() -> None:
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    original = logits.clone()
    bitmask = torch.full((3, 3), ALL, dtype=torch.int32)
    allowed_rows = {0: {0, 5, 31, 32, 63, 64, 69}, 2: {31}}  # 31 and 63: the sign bit of a word
    for row, ids in allowed_rows.items():
        bitmask[row] = 0
        for t in ids:
            word, bit = divmod(t, 32)
            value = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
    bitmask[1] = 0  # row 1 forbids everything but is not listed: left alone
    apply_bitmask(logits, bitmask, [0, 2])
    for row in range(3):
        for t in range(vocab):
            if row in allowed_rows and t not in allowed_rows[row]:
                assert logits[row, t] == float("-inf"), (row, t)
            else:
                assert logits[row, t] == original[row, t], (row, t)


def test_apply_bitmask_with_a_manager_mask_keeps_greedy_inside_the_grammar(so: StructuredOutputs) -> None:
    constrained(so, request("c", regex=DLD))
    logits = torch.randn(2, SMOLLM2_VOCAB, generator=torch.Generator().manual_seed(1))
    logits[:, tid("x")] = 100.0  # the unconstrained choice
    bitmask, rows = so.bitmask([("c", []), ("free", [])])
    StructuredOutputs.apply(logits, bitmask, rows)
    assert int(logits[0].argmax()) in {tid(str(d)) for d in range(10)}
    assert int(logits[1].argmax()) == tid("x")
    assert torch.isfinite(logits[1]).all()
    assert int(torch.isfinite(logits[0]).sum()) == 10
