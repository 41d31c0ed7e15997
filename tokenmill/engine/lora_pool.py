"""LoRAPool: which adapter sits in which of the model's slots (model/lora.py), and the adapters' weights as read
from disk.

An adapter's weights are read when the first request for it is added (a bad directory fails that request, not the
engine) and kept while any request uses it, plus the most recently used others up to the slots' count. A step's
adapters get slots as it runs: one already in a slot stays there; a new one takes a free slot, else the least
recently used slot of an adapter this step does not run. The scheduler keeps a step's adapters within the slots
(SchedulerConfig.max_loras), so a slot is always found.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from tokenmill.lora.adapter import load_adapter_weights, read_adapter_config
from tokenmill.model.lora import attach_lora, lora_slots

if TYPE_CHECKING:
    import torch

    from tokenmill.engine.step_types import ScheduledRequest
    from tokenmill.lora.adapter import AdapterWeights
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model_config import ModelConfig

BASE = -1  # a request without an adapter: no slot


class LoRAPool:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_slots: int, max_rank: int):
        self.cfg, self.num_slots, self.max_rank = cfg, num_slots, max_rank
        self.batch = attach_lora(model, num_slots, max_rank)
        self.slots = lora_slots(model)
        self.names: list[str | None] = [None] * num_slots  # the adapter in each slot
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))  # LRU first
        self.weights: OrderedDict[str, AdapterWeights] = OrderedDict()  # read adapters, least recently used first
        self.users: Counter[str] = Counter()  # requests in flight per adapter
        self.retired: set[str] = set()  # unloaded while requests still ran through it: dropped when they end

    def describe(self) -> str:
        mib = sum(s.nbytes() for _, s in self.slots) / 2**20
        return f"LoRA: {self.num_slots} adapter slots of rank <= {self.max_rank}, {mib:.0f} MiB"

    # ---- requests ----------------------------------------------------------------------------------------
    def acquire(self, lora: LoRARequest) -> None:
        """A request for `lora` arrived: read its weights now if they are not (InvalidRequest if they cannot be)."""
        name = lora.lora_name
        self.retired.discard(name)
        if name not in self.weights:
            config = read_adapter_config(lora.lora_path, self.max_rank)
            self.weights[name] = load_adapter_weights(config, self.cfg, self.max_rank)
        self.weights.move_to_end(name)
        self.users[name] += 1

    def release(self, name: str) -> None:
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            if name in self.retired:
                self._forget(name)
        self._trim()

    def unload(self, name: str) -> None:
        """Forget the adapter now, or once the requests running through it end (a later request reads it again)."""
        if name in self.users:
            self.retired.add(name)
        else:
            self._forget(name)

    def _forget(self, name: str) -> None:
        self.retired.discard(name)
        self.weights.pop(name, None)
        if name in self.names:
            self._clear(self.names.index(name))

    def _trim(self) -> None:
        """Keep the weights of adapters in use, and of up to `num_slots` others (the most recent)."""
        idle = [n for n in self.weights if n not in self.users]
        for name in idle[:max(len(idle) - self.num_slots, 0)]:
            del self.weights[name]

    # ---- one step ------------------------------------------------------------------------------------------
    def slot_of(self, scheduled: ScheduledRequest) -> int:
        lora = scheduled.request.lora_request
        return BASE if lora is None else self.names.index(lora.lora_name)

    def prepare(self, paged: list[ScheduledRequest], fresh: list[ScheduledRequest]
                ) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """A step's requests (the paged ones, then the fresh ones, as the runner lays out rows): their adapters
        bound to slots, each group ordered by slot (one run of rows per adapter), the runs set. A step without
        adapters is left as it is."""
        wanted = list(dict.fromkeys(s.request.lora_request.lora_name for s in (*paged, *fresh)
                                    if s.request.lora_request is not None))
        if not wanted:
            self.clear_runs()
            return paged, fresh
        self._bind(wanted)
        paged, fresh = sorted(paged, key=self.slot_of), sorted(fresh, key=self.slot_of)
        self._set_runs(paged + fresh)
        return paged, fresh

    def _bind(self, wanted: list[str]) -> None:
        """Give each adapter of the step a slot, filling the slots of those not in one."""
        for name in wanted:
            if name in self.names:
                slot = self.names.index(name)
            else:
                slot = next((s for s in self.slot_use if self.names[s] is None), None)
                if slot is None:
                    slot = next((s for s in self.slot_use if self.names[s] not in wanted), None)
                if slot is None:  # the scheduler keeps a step's adapters within the slots (max_loras)
                    raise RuntimeError(f"{len(wanted)} adapters in one step, more than the {self.num_slots} slots")
                self._fill(slot, name)
            self.slot_use.move_to_end(slot)

    def _set_runs(self, ordered: list[ScheduledRequest]) -> None:
        """The step's rows, request after request in `ordered`, as runs of one slot each (BASE rows left out)."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for s in ordered:
            slot, end = self.slot_of(s), row + s.num_new_tokens
            if slot != BASE:
                if runs and runs[-1][2] == slot and runs[-1][1] == row:
                    runs[-1] = (runs[-1][0], end, slot)
                else:
                    runs.append((row, end, slot))
            row = end
        self.batch.set(runs)

    def clear_runs(self) -> None:
        self.batch.set([])

    def _fill(self, slot: int, name: str) -> None:
        weights = self.weights.get(name)
        if weights is None:
            raise RuntimeError(f"LoRA adapter {name!r} was not read before its request ran")
        per_layer: dict[int, dict] = {}
        for (layer, target), pair in weights.items():
            per_layer.setdefault(layer, {})[target] = pair
        for layer, slots in self.slots:
            slots.fill(slot, per_layer.get(layer, {}))
        self.names[slot] = name

    def _clear(self, slot: int) -> None:
        for _, slots in self.slots:
            slots.clear(slot)
        self.names[slot] = None
