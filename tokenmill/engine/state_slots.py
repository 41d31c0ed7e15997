"""StateSlots: the fixed-size state of a hybrid model's recurrent and convolution layers, one slot per running
request (plain Python: the state tensors live in the model runner, `[num_slots, ...]` per state layer; here a
slot is only an id).

A request takes a slot when it is admitted and gives it back through KVCacheManager.free, the one way its blocks
return too (finish, abort, preemption, error). Its state is the whole sequence's so far, so a preempted request
computes it again from its first token (the runner zeroes a slot whenever a request starts at position 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.request import Request


class StateSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, request: Request) -> bool:
        """Give `request` a slot unless it holds one; False (nothing changed) if none is free."""
        if request.state_slot is not None:
            return True
        if not self._free:
            return False
        request.state_slot = self._free.pop()
        return True

    def give_back(self, request: Request) -> None:
        """Idempotent: a request without a slot gives nothing back."""
        if request.state_slot is not None:
            assert request.state_slot not in self._free, f"state slot {request.state_slot} freed twice"
            self._free.append(request.state_slot)
            request.state_slot = None

    def check_idle(self) -> None:
        assert sorted(self._free) == list(range(self.num_slots)), (
            f"{self.num_slots - len(set(self._free))} state slots held with nothing running")
