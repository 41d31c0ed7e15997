"""backends/huge_pages.py: packed weights moved into one MADV_HUGEPAGE mapping, values and references intact."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tokenmill.engine.runner import ModelRunner, weight_bytes
from tokenmill.model import cpu_kernels
from tokenmill.model.backends import huge_pages
from tokenmill.model.backends.huge_pages import HUGE_PAGE, huge_pages_available, move_to_huge_pages
from tokenmill.model.loader import load_model_config, load_weights


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def holders() -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(0)
    return [SimpleNamespace(w=torch.randint(0, 256, (3, 4, 320), dtype=torch.uint8, generator=g)),
            SimpleNamespace(w=torch.randn(48, 96, generator=g).bfloat16()),
            SimpleNamespace(w=torch.randn(5, 7, generator=g).to(torch.float8_e4m3fn)),
            SimpleNamespace(w=torch.randn(33, generator=g))]


def test_moved_tensors_keep_their_values_in_one_madvised_mapping():
    objs = holders()
    before = [o.w.clone() for o in objs]
    moved = move_to_huge_pages([(o, "w") for o in objs])
    if not huge_pages_available():
        assert moved == 0 and all(torch.equal(o.w.view(torch.uint8), b.view(torch.uint8))
                                  for o, b in zip(objs, before))
        return
    assert moved >= sum(b.numel() * b.element_size() for b in before)
    for o, b in zip(objs, before):
        assert o.w.dtype == b.dtype and o.w.shape == b.shape and o.w.is_contiguous()
        assert torch.equal(o.w.view(torch.uint8), b.view(torch.uint8))
        assert o.w.data_ptr() % 64 == 0
    storage = objs[0].w.untyped_storage()
    assert all(o.w.untyped_storage().data_ptr() == storage.data_ptr() for o in objs)  # side by side, one arena
    assert storage.data_ptr() % HUGE_PAGE == 0 and storage.nbytes() == moved  # aligned; only the bytes used
    assert "hg" in mapping_flags(storage.data_ptr())  # madvise(MADV_HUGEPAGE) took
    objs[1].w.add_(1)  # a view of the arena is an ordinary tensor
    assert torch.equal(objs[1].w, before[1] + 1)


def test_nothing_moves_without_huge_pages_or_for_a_strided_tensor(monkeypatch):
    objs = holders()
    originals = [o.w for o in objs]
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    assert move_to_huge_pages([(o, "w") for o in objs]) == 0
    monkeypatch.undo()
    strided = SimpleNamespace(w=torch.randn(8, 8).t())
    assert move_to_huge_pages([(o, "w") for o in objs] + [(strided, "w")]) == 0
    assert all(o.w is t for o, t in zip(objs, originals))


@pytest.mark.skipif(cpu_kernels._extension() is None, reason="no C++ kernels: nothing is packed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backend_moves_its_packed_weights(tmp_path, monkeypatch, dtype):
    path = make_tiny_model(tmp_path, tie_word_embeddings=True)
    cfg = load_model_config(path)

    def runner() -> ModelRunner:
        return ModelRunner(cfg, load_weights(path, cfg, dtype), dtype, "cpu", num_blocks=8, block_size=16)

    moved = runner().model
    packed = [m.packed_weight for m in moved.linear_layers()
              if isinstance(m.packed_weight, torch.Tensor) and not m.packed_weight.is_mkldnn]
    if dtype == torch.bfloat16 and cpu_kernels._extension().bf16_kernel():
        assert packed  # bfloat16 tiles (csrc/bf16_linear.cpp)
    storages = {p.untyped_storage().data_ptr() for p in packed}
    if huge_pages_available() and packed:
        assert len(storages) == 1 and "hg" in mapping_flags(storages.pop())
    else:
        assert len(storages) == len(packed)  # each where torch allocated it
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    unmoved = runner().model
    # the arena's bytes count once, not once per view (up to a cache line of padding per tensor)
    assert weight_bytes(unmoved) <= weight_bytes(moved) <= weight_bytes(unmoved) + 64 * len(packed)
    ids = torch.tensor([[1, 5, 9], [200, 7, 3]])
    assert torch.equal(moved.embed_tokens(ids), unmoved.embed_tokens(ids))  # a tied head's rows, if read from it

