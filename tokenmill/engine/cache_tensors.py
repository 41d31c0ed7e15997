"""CacheTensors: the tensors a model's layers keep between steps, laid out as engine/kv_layout.py says, and the
one mapping from a request's blocks to KV slots.

Paged layers (attention, window) get one key and one value tensor per page slot, `[blocks, block_size, kv heads,
head dim]`; a state layer (model/layer_cache.py) gets its state tensors, `[state slots + snapshots, *shape]`: the
running requests' slots, then the snapshot rows prefix caching copies states to and from (engine/state_snapshots.py).
`per_layer[i]` is what layer i is handed each step. The runner builds the step's tensors; this object owns the
cache's.
"""

from __future__ import annotations

import torch

from tokenmill.engine.kv_layout import KVLayout


def token_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat KV slot (block * block_size + offset) of each position in [start, end) of a sequence whose
    blocks (or one table's pages) are `block_ids`."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


class CacheTensors:
    def __init__(self, layout: KVLayout, page_shape: tuple[int, ...], kv_dtype: torch.dtype, device: torch.device,
                 num_state_slots: int = 0, num_snapshots: int = 0):
        self.layout = layout
        self.block_size, self.device = page_shape[1], device
        # Zeroed, not empty: masked-out slots are still multiplied by 0 and must not hold NaN bit patterns.
        pages = [(torch.zeros(page_shape, dtype=kv_dtype, device=device),
                  torch.zeros(page_shape, dtype=kv_dtype, device=device)) for _ in range(layout.num_slots)]
        self.per_layer: list[tuple[torch.Tensor, ...]] = []
        for i, slot in enumerate(layout.layer_slots):
            if slot is not None:
                self.per_layer.append(pages[slot])
            else:
                c = layout.caches[i]
                dtype = getattr(torch, c.state_dtype)
                rows = num_state_slots + num_snapshots
                self.per_layer.append(tuple(torch.zeros((rows, *shape), dtype=dtype, device=device)
                                            for shape in c.state_shapes))
        self._states = [self.per_layer[i] for i in layout.state_layers]

    @property
    def has_state(self) -> bool:
        return bool(self._states)

    def paged_layers(self) -> list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        """(layer, (keys, values)) of every paged layer."""
        return [(i, kv) for i, kv in enumerate(self.per_layer) if self.layout.layer_slots[i] is not None]

    def slot_index(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """token_slots of positions [start, end) as a tensor on the cache's device."""
        return torch.tensor(token_slots(block_ids, start, end, self.block_size), dtype=torch.long, device=self.device)

    # ---- per-request state (state layers only) ---------------------------------------------------------------
    def reset_states(self, slots: list[int]) -> None:
        """Zero these state slots: their requests start at position 0 (new, or recomputed after preemption)."""
        if slots and self._states:
            index = torch.tensor(slots, dtype=torch.long, device=self._states[0][0].device)
            for tensors in self._states:
                for t in tensors:
                    t.index_fill_(0, index, 0)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Row `dst` of every state tensor becomes a copy of row `src`, for each (src, dst): a snapshot into a slot
        or a slot into a snapshot."""
        if pairs and self._states:
            device = self._states[0][0].device
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=device)
            for tensors in self._states:
                for t in tensors:
                    t.index_copy_(0, dst, t.index_select(0, src))

