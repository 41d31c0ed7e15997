"""RequestHooks: a feature's part in each request's life, as the engine core calls it.

Speculation, structured output and KV transfer each keep state per request beside the scheduler. Each is one
object with these methods, called by the core from one place each (engine/core.py `step`, `add_request`,
`_release`), so the core stays the loop and a feature's state lives in its own module. Every sequence leaves
through `on_release`, whatever stage it ended in: that is where nothing can stay behind. Plain Python: the hooks
see requests and scheduler outputs, never tensors (the runner builds those).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine.messages import AddRequest, EngineCoreOutput
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.engine.step_types import SchedulerOutput, StepResult
    from tokenmill.errors import ServerBusy
    from tokenmill.request import Request


class RequestHooks:
    """Every method does nothing by default; a feature overrides what it needs."""

    def on_add(self, request: Request, msg: AddRequest) -> bool:
        """A new sequence. True if this hook holds it outside the scheduler (it hands it over in
        `before_schedule`); raising refuses it (the core releases it)."""
        return False

    def before_schedule(self, scheduler: Scheduler) -> list[tuple[str, str | ServerBusy]]:
        """Before each schedule: hand held sequences to the scheduler; returns (sequence id, why) for those that
        failed while held (the core ends them with an error; a ServerBusy why says a retry may succeed)."""
        return []

    def before_execute(self, sched: SchedulerOutput) -> None:
        """The step is scheduled (blocks allocated); the forward pass comes next."""

    def after_execute(self, sched: SchedulerOutput, result: StepResult) -> None:
        """The forward pass ran; nothing is freed or advanced yet (the step's KV is still in its blocks)."""

    def after_update(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        """The scheduler took the step's tokens; returns the requests this hook ended (already finished in the
        scheduler), for the core to release."""
        return []

    def on_outputs(self, outputs: list[EngineCoreOutput], idle: bool) -> list[EngineCoreOutput]:
        """The step's outputs before they go out (`idle`: the step scheduled nothing): a hook may hold some back."""
        return outputs

    def on_preempt(self, request: Request) -> None:
        """The request lost its KV and will be recomputed."""

    def on_client_end(self, request_id: str) -> None:
        """The client ended the sequence (an abort, or a stop string the detokenizer found): nothing waits for
        its output any more. `on_release` follows."""

    def on_release(self, request_id: str) -> None:
        """The sequence ended, any way: drop everything kept for it. Idempotent."""

    @property
    def pending(self) -> bool:
        """Work in flight outside the scheduler (a held sequence, an outcome awaited): the core keeps stepping."""
        return False

    @property
    def allows_runs(self) -> bool:
        """Whether a step may run several decode steps at once (--num-scheduler-steps): not while anything acts
        between tokens."""
        return True

    def check_idle(self) -> None:
        """With nothing in flight: assert that no per-request state is left."""

    def close(self) -> None:
        """Stop what runs beside the engine (threads, connections)."""
