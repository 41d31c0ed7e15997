"""The engine's side of structured output: each constrained request's matcher, the bitmask of a step's sampling
rows, and the matchers' advance on the tokens a step kept. Requests without a constraint cost nothing: a step with
none of them never builds a mask.

With speculative decoding a request samples 1 + k rows: row j is masked as the grammar stands after the first j
drafts (the matcher consumes the valid ones, fills, then rolls back). A draft the grammar forbids ends the masked
rows there: the target's masked token at that row cannot be the forbidden draft, so verification rejects it and
the rows after it are never used.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.errors import ServerBusy
from tokenmill.structured.backend import GrammarCache, MatcherFactory, grammar_text
from tokenmill.structured_params import COMMON_CONSTRAINTS

log = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)
BUILD_TIMEOUT_S = 10.0  # a matcher not built by then fails its request (503: a retry may find it built)
FACTORY_TIMEOUT_S = 60.0  # the tokenizer's matcher tables, loaded once at the first constrained request
BUILD_WORKERS = 2  # matchers built at once: one slow grammar leaves the other builder to the requests behind it


class _Builds:
    """Builds in flight, one per grammar, shared by the requests waiting for it (n > 1, a batch of prompts): the
    engine thread's bookkeeping (no lock)."""

    def __init__(self) -> None:
        self._by_key: dict[Any, tuple[cf.Future, int]] = {}  # grammar key -> (its build, requests waiting for it)
        self._keys: dict[cf.Future, Any] = {}

    def join(self, key: Any, start: Callable[[], cf.Future]) -> cf.Future:
        future, users = self._by_key.get(key, (None, 0))
        if future is None:
            future = start()
            self._keys[future] = key
        self._by_key[key] = (future, users + 1)
        return future

    def leave(self, future: cf.Future, cancel: bool) -> None:
        """A request stops waiting; with `cancel`, the build is cancelled if no one else waits for it (it never
        runs if it has not started)."""
        key = self._keys.get(future)
        if key is None:  # an outcome known at submission, not a build
            return
        _, users = self._by_key[key]
        if users > 1:
            self._by_key[key] = (future, users - 1)
            return
        del self._by_key[key], self._keys[future]
        if cancel:
            future.cancel()


class StructuredOutputs:
    """A constrained request first waits here, outside the scheduler, while a builder thread builds its matcher (the
    grammar checked by the API process, or here when it came in-process without one); `ready` hands it to the
    scheduler, or fails it, so a slow grammar never holds a step. Builds run on a few threads, one per grammar
    whatever the number of requests waiting for it; a grammar built (or refused) before is answered at once,
    without queueing behind new ones.

    A build cannot be interrupted (llguidance has no cancel; a thread cannot be stopped): a request waiting past
    `timeout_s` fails at once and its build, if not started, never runs; a build already running finishes its work,
    bounded by llguidance's limits (and, behind a server, by the API process's check of the same grammar, of a
    like cost, having passed the same time limit), and its outcome is kept for the next request with that
    grammar. A request's time limit counts from when the tokenizer's tables are loaded (once, at the first
    constrained request, bounded by FACTORY_TIMEOUT_S), so a busy CPU slowing that load fails no grammar; the common
    grammars (params.COMMON_CONSTRAINTS) are built with the tables. A request past its limit fails as ServerBusy (HTTP 503 with
    Retry-After): its grammar may be built by the time it is sent again."""

    def __init__(self, vocab_size: int, load_tokenizer: Callable[[], Any], timeout_s: float = BUILD_TIMEOUT_S,
                 workers: int = BUILD_WORKERS):
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._load_tokenizer = load_tokenizer
        self._factory: MatcherFactory | None = None
        self._factory_at: float | None = None  # when the tables were loaded (time.monotonic())
        self._factory_lock = threading.Lock()
        self._grammars = GrammarCache()
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")
        self._builds = _Builds()
        self._pending: dict[str, tuple[Any, cf.Future, float]] = {}  # id -> (request, its matcher, since)
        self._matchers: dict[str, Any] = {}  # request id -> llguidance.LLMatcher

    # ---- waiting for a matcher -------------------------------------------------------------------------------
    def submit(self, request: Any, grammar: str | None) -> None:
        """Build `request`'s matcher off the step loop: from `grammar` text, or its params' constraint."""
        spec = request.params.structured_outputs
        future = self._known(grammar) or self._builds.join(
            grammar if grammar is not None else spec.key, lambda: self._pool.submit(self._build, spec, grammar))
        self._pending[request.request_id] = (request, future, time.monotonic())

    def _known(self, grammar: str | None) -> cf.Future | None:
        """The outcome of a grammar built (or refused) before, already done; None if it must be built."""
        if grammar is None or self._factory is None:
            return None
        done: cf.Future = cf.Future()
        try:
            matcher = self._factory.cached(grammar)
        except ValueError as e:
            done.set_exception(e)
            return done
        if matcher is None:
            return None
        done.set_result(matcher)
        return done

    def _build(self, spec: Any, grammar: str | None) -> Any:
        return self._matcher_factory().matcher(grammar if grammar is not None else self._grammars.check(spec))

    def _matcher_factory(self) -> MatcherFactory:
        with self._factory_lock:  # the builders share one (loading the tokenizer takes a while)
            if self._factory is None:
                factory = MatcherFactory(self._load_tokenizer(), self.vocab_size)
                for spec in COMMON_CONSTRAINTS:
                    factory.matcher(grammar_text(spec))
                self._factory, self._factory_at = factory, time.monotonic()
        return self._factory

    def _overdue(self, since: float, now: float) -> bool:
        """Whether a request waiting since `since` has waited too long: BUILD_TIMEOUT_S from when the tables were
        loaded (or from its submission, if later), FACTORY_TIMEOUT_S while they are still loading."""
        loaded_at = self._factory_at
        if loaded_at is None:
            return now - since > FACTORY_TIMEOUT_S
        return now - max(since, loaded_at) > self.timeout_s

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def ready(self, wait_s: float = 0.0) -> tuple[list[Any], list[tuple[Any, str | ServerBusy]]]:
        """Requests whose matcher is built (now constrained here: schedule them) and those that failed, with why
        (their grammar did not build, or not within `timeout_s` of their submission); waits up to `wait_s` for
        the first to finish when none has. Each request leaves the pending set in exactly one of the two lists,
        once; a failed one holds nothing here."""
        if wait_s > 0 and self._pending and not any(f.done() for _, f, _ in self._pending.values()):
            cf.wait([f for _, f, _ in self._pending.values()], timeout=wait_s, return_when=cf.FIRST_COMPLETED)
        ok, failed, now = [], [], time.monotonic()
        for rid, (request, future, since) in list(self._pending.items()):
            if not future.done() and not self._overdue(since, now):
                continue
            del self._pending[rid]
            self._builds.leave(future, cancel=True)
            if not future.done() or future.cancelled():
                failed.append((request, ServerBusy(f"structured output: the grammar was not built within "
                                                   f"{self.timeout_s:g} s on this busy server; retry, or simplify it",
                                                   retry_after=max(1, round(self.timeout_s)))))
                continue
            try:
                self._matchers[rid] = future.result().deep_copy()  # its own: the build may be shared
                ok.append(request)
            except Exception as e:  # noqa: BLE001 - whatever building raised, the request's constraint caused it
                failed.append((request, f"structured output: {e}"))
        return ok, failed

    def discard(self, request_id: str) -> bool:
        """Forget a request (aborted, finished); True if it was still waiting for its matcher."""
        self._matchers.pop(request_id, None)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._builds.leave(pending[1], cancel=True)
        return pending is not None

    def release(self, request_id: str) -> None:
        self.discard(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, spans: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed-token bitmask ([rows, vocab / 32] int32, bit set = allowed) of a step's sampling rows and
        the rows it constrains (None: none is). `spans`: per sampled request in row order, its id and the drafts
        this step verifies."""
        if not self._matchers or not any(rid in self._matchers for rid, _ in spans):
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((sum(1 + len(d) for _, d in spans), words), -1, dtype=torch.int32)
        rows, row = [], 0
        for rid, drafts in spans:
            m = self._matchers.get(rid)
            if m is not None:
                valid = m.validate_tokens(drafts) if drafts else 0
                for j in range(valid + 1):
                    m.unsafe_compute_mask_ptr(bitmask[row + j].data_ptr(), words * 4)
                    rows.append(row + j)
                    if j < valid:
                        m.consume_token(drafts[j])
                if valid:
                    m.rollback(valid)
            row += 1 + len(drafts)
        return bitmask, rows

    def advance(self, request_id: str, tokens: list[int]) -> str | None:
        """Walk the request's matcher over the tokens a step kept: None while its grammar goes on, "stopped" once
        it has ended (the next mask allows only EOS, so the request ends the usual way), "error" if it refused a
        token (only allowed tokens are sampled: a bug, not the client's)."""
        m = self._matchers.get(request_id)
        if m is None:
            return None
        for t in tokens:
            if not m.consume_token(t):
                log.warning("request %s: the grammar refused token %d it had allowed (%s); ending the request",
                            request_id, t, m.get_error())
                return "error"
        return "stopped" if m.is_stopped() else None


    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        apply_bitmask(logits, bitmask, rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf, in place, on the tokens each listed row's bitmask forbids (logits [R, V], float)."""
    idx = torch.tensor(rows, dtype=torch.long)
    words = bitmask[idx]
    allowed = ((words.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), -1)[:, :logits.shape[1]].bool()
    dev_idx = idx.to(logits.device)
    logits[dev_idx] = logits[dev_idx].masked_fill(~allowed.to(logits.device), float("-inf"))
