"""Parallelism over torch.distributed: how a model splits across tensor-parallel ranks and pipeline stages
(layout.py), the ranks' collectives (group.py), rank 0's side of each model call (driver.py), the executor that
starts and owns the other ranks (executor.py, through launch.py or ray_executor.py), the worker ranks (worker.py),
and context parallelism (context.py, its arithmetic in ring.py)."""
