"""`--distributed-executor-backend ray`: ranks 1..N-1 as Ray tasks on a local Ray cluster give one process's greedy
output (tensor and context parallelism); a rank whose task dies stops the engine within seconds, and one that dies
while the engine idles is found by the health check; bad layouts and a missing Ray are refused naming the fix."""

from __future__ import annotations

import sys
import time

import pytest

from tests.models.tiny import make_tiny_model
from tests.parallel.test_tensor_parallel import dying_rank_stops_the_engine, prompts, run
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.parallel.ray_executor import RayRank
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """One small local Ray cluster for the module (the engine joins it), shut down after."""
    import ray  # the test extra: `make test` installs it
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ray"), num_heads=4, num_kv_heads=2, vocab_size=256)


def core(model, executor: str, **parallel) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), dtype="float32", num_threads=1,
                                   distributed_executor_backend=executor,
                                   cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=16), **parallel))


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"context_parallel_size": 2}],
                         ids=["tensor", "context"])
def test_ray_ranks_give_one_process_output(ray_cluster, gqa, parallel):
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(3))}
    ref = run(core(gqa, "mp"), requests)
    engine = core(gqa, "ray", **parallel)
    try:
        assert all(isinstance(p, RayRank) for p in engine.executor.ranks.procs)
        assert run(engine, requests) == ref
    finally:
        engine.close()
    assert engine.executor.ranks is None


def test_a_ray_rank_that_dies_mid_request_stops_the_engine_within_seconds(ray_cluster, gqa):
    engine = core(gqa, "ray", tensor_parallel_size=2)
    engine.check_health()  # all ranks up
    dying_rank_stops_the_engine(engine, kill=RayRank.kill)  # the task's worker process is killed


def test_a_ray_rank_that_dies_while_idle_fails_the_health_check(ray_cluster, gqa):
    engine = core(gqa, "ray", context_parallel_size=2)
    try:
        engine.check_health()
        engine.executor.ranks.procs[0].kill()
        deadline = time.monotonic() + 10
        with pytest.raises(ParallelFailure, match=r"parallel rank 1 \(ray task .*\) exited with code 1"):
            while time.monotonic() < deadline:
                engine.check_health()
                time.sleep(0.1)
    finally:
        engine.executor.ranks.kill()


def test_ray_is_refused_with_nnodes_and_named_when_missing(monkeypatch):
    with pytest.raises(ConfigError, match="drop --nnodes"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_port=29500, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match="must be mp or ray"):
        EngineConfig(distributed_executor_backend="slurm")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(ConfigError, match="pip install ray"):
        RayRank(1, 2, "tcp://127.0.0.1:1", "gloo", 30.0, 1)
