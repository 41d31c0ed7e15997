"""Tensor parallelism over torch.distributed: the layout of a model across ranks (layout.py), their collectives
(group.py), rank 0's side (driver.py) and the worker ranks (worker.py)."""
