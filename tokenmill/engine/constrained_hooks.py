"""Structured output at the engine core: a constrained request's part in its life, as RequestHooks
(engine/hooks.py).

A constrained sequence waits outside the scheduler while its matcher builds (`on_add` holds it,
`before_schedule` hands it over, or fails it, so a slow grammar never holds a step); after each step its matcher
consumes the tokens kept (`after_update`), which may end it. The manager (structured/manager.py) is made at the
first constrained request: a server that never sees one never loads a tokenizer here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.engine.hooks import RequestHooks
from tokenmill.request import RequestStatus

if TYPE_CHECKING:
    from tokenmill.engine.messages import AddRequest
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.engine.step_types import SchedulerOutput, StepResult
    from tokenmill.errors import ServerBusy
    from tokenmill.request import Request
    from tokenmill.structured.manager import StructuredOutputs


class ConstrainedDecoding(RequestHooks):
    def __init__(self, vocab_size: int, load_tokenizer: Callable[[], Any], scheduler: Scheduler):
        self.vocab_size, self.load_tokenizer = vocab_size, load_tokenizer
        self.scheduler = scheduler
        self.manager: StructuredOutputs | None = None

    def _manager(self) -> StructuredOutputs:
        if self.manager is None:
            from tokenmill.structured.manager import StructuredOutputs

            self.manager = StructuredOutputs(self.vocab_size, self.load_tokenizer)
        return self.manager

    def on_add(self, request: Request, msg: AddRequest) -> bool:
        if request.params.structured_outputs is None:
            return False
        self._manager().submit(request, msg.grammar)
        return True

    def before_schedule(self, scheduler: Scheduler) -> list[tuple[str, str | ServerBusy]]:
        """Sequences whose matcher is built join the scheduler; with nothing else to run, waits a little for a
        build rather than spin."""
        m = self.manager
        if m is None or not m.num_pending:
            return []
        ok, failed = m.ready(0.0 if scheduler.has_unfinished else 0.005)
        for request in ok:
            scheduler.add_request(request)
        return [(request.request_id, why) for request, why in failed]

    def before_execute(self, sched: SchedulerOutput) -> None:
        """The step carries the matchers: the runner masks its constrained rows' logits with them."""
        if self.manager is not None and len(self.manager):
            sched.grammar = self.manager

    def after_update(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        """Matchers consume the tokens kept. A grammar that has ended lets only EOS through, which ends the request
        as usual; with ignore_eos it ends here, on that EOS (as a stop, the EOS's text hidden); a refused token
        ends it too."""
        m = self.manager
        if m is None or not len(m):
            return []
        ended = []
        for s in sched.scheduled:
            req, got = s.request, result.sampled.get(s.request.request_id)
            if got is None or req.request_id not in m or req.status.finished:
                continue
            state = m.advance(req.request_id, got.token_ids)
            if state == "error":
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                ended.append(req)
            elif state == "stopped" and got.token_ids[-1:] and got.token_ids[-1] in req.eos_token_ids:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                ended.append(req)
        return ended

    def on_release(self, request_id: str) -> None:
        if self.manager is not None:
            self.manager.release(request_id)

    @property
    def pending(self) -> bool:
        return self.manager is not None and self.manager.num_pending > 0

    @property
    def allows_runs(self) -> bool:
        return self.manager is None or not len(self.manager)  # a grammar advances token by token

    def check_idle(self) -> None:
        assert self.manager is None or not (len(self.manager) or self.manager.num_pending), \
            "structured-output state outlived its requests"

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
