"""Shared-memory collectives among processes of one host: sums and gathers of several dtypes and shapes, back to
back (the two alternating slot sets), the same bits on every rank; a rank that dies is noticed within a fraction of
a second and one that stalls fails the call at the timeout, never a hang; the engine's ranks use them here."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tokenmill.parallel.shm_collectives import SLOT_BYTES, ShmCollectives, host_id, new_path

SIZE = 3


def _rank(rank: int, path: str, ready, queue, mode: str) -> None:
    ready.wait(30)  # rank 0 created the file
    coll = ShmCollectives(path, rank, SIZE, timeout_s=1.5, create=False)
    results = []
    try:
        for step in range(50):  # back to back: both slot sets reused many times
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(7, 5, generator=g).to(torch.bfloat16 if step % 2 else torch.float32)
            if mode == "dies" and rank == 2 and step == 10:
                os._exit(0)
            if mode == "stalls" and rank == 2 and step == 10:
                time.sleep(30)
            summed = coll.all_reduce(x.clone())
            gathered = coll.all_gather(torch.full((step + 1,), rank, dtype=torch.int64))
            to_driver = coll.gather(torch.tensor([rank * step]))
            results.append((str(summed.dtype), summed.float().tolist(), gathered.tolist(),
                            None if to_driver is None else to_driver.flatten().tolist()))
        queue.put((rank, "ok", results))
    except RuntimeError as e:
        queue.put((rank, str(e), None))


def run_ranks(mode: str) -> dict[int, tuple]:
    path = new_path()
    creator = ShmCollectives(path, 0, SIZE, timeout_s=1.5, create=True)  # makes the file; rank 0 reopens it
    ctx = mp.get_context("spawn")
    ready, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, path, ready, queue, mode)) for r in range(SIZE)]
    for p in procs:
        p.start()
    ready.set()
    try:
        expected = SIZE - (mode != "ok")
        return {r: (msg, res) for r, msg, res in (queue.get(timeout=60) for _ in range(expected))}
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        os.unlink(path)
        creator.close()


def test_sums_and_gathers_are_exact_and_the_same_on_every_rank():
    out = run_ranks("ok")
    assert all(msg == "ok" for msg, _ in out.values())
    for step in range(50):
        xs = [torch.randn(7, 5, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(SIZE)]
        dtype = torch.bfloat16 if step % 2 else torch.float32
        want = xs[0].to(dtype) + xs[1].to(dtype) + xs[2].to(dtype)  # in rank order, in the dtype
        for rank in range(SIZE):
            dtype_name, summed, gathered, to_driver = out[rank][1][step]
            assert dtype_name == str(dtype) and summed == want.float().tolist()
            assert gathered == [[r] * (step + 1) for r in range(SIZE)]
            assert (to_driver is not None) == (rank == 0)
        assert out[0][1][step][3] == [0, step, 2 * step]


@pytest.mark.parametrize("mode, message", [("dies", "parallel rank 2 .* is gone"),
                                           ("stalls", "waited .* s for rank")])
def test_a_rank_that_dies_or_stalls_fails_the_call(mode, message):
    start = time.monotonic()
    out = run_ranks(mode)
    assert time.monotonic() - start < 20
    for rank in (0, 1):
        assert out[rank][1] is None
        assert re.search(message, out[rank][0]), out[rank][0]


def test_only_small_cpu_tensors_go_through_shared_memory():
    assert ShmCollectives.fits(torch.empty(SLOT_BYTES // 4))
    assert not ShmCollectives.fits(torch.empty(SLOT_BYTES // 4 + 1))
    assert not ShmCollectives.fits(torch.empty(4, device="meta"))


def test_the_engine_ranks_use_shared_memory_on_one_host(tmp_path):
    from tests.models.tiny import make_tiny_model
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.core import EngineCore

    model = make_tiny_model(tmp_path, num_heads=4, num_kv_heads=2)
    engine = EngineCore(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=2, num_threads=1,
                                     cache=CacheConfig(kv_cache_memory=4 << 20)))
    try:
        assert (engine.executor.ranks.group.local is not None) == (host_id() is not None)
        assert not list(Path("/dev/shm").glob("tokenmill-collectives-*"))  # unlinked at once
    finally:
        engine.close()
