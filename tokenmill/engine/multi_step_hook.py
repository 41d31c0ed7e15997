"""Multi-step decode's part in the engine core's loop (engine/hooks.py): whether a step may run several decodes.
Which requests and how far is the scheduler's (engine/multi_step.py run_length); running them is the runner's
(engine/multi_step_runner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.engine.hooks import RequestHooks

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import Scheduler


class MultiStepDecode(RequestHooks):
    """The engine core's hook for multi-step decode: before each schedule, whether this step may run several decodes
    (the configured `max_steps` where the runner holds the whole model and no other hook acts between tokens: a
    grammar, a speculator, a KV transfer)."""

    def __init__(self, max_steps: int, others: list[RequestHooks]):
        self.max_steps, self.others = max_steps, others

    def before_schedule(self, scheduler: Scheduler) -> list[tuple[str, str]]:
        scheduler.limit_runs(self.max_steps if all(hook.allows_runs for hook in self.others) else 1)
        return []
