"""An embedding request's result from its pooled hidden state (Request.pooled, built by the runner chunk by
chunk): the mean's division, the L2 normalization (as torch.nn.functional.normalize: a norm of at least 1e-12),
float32 values. Plain Python: the engine core calls it, no tensors."""

from __future__ import annotations

import math
from array import array

from tokenmill.request import Request


def embedding(req: Request) -> list[float]:
    values = list(req.pooled or [])
    if req.params.pooling == "mean":
        values = [x / req.num_prompt_tokens for x in values]
    if req.params.normalize:
        norm = max(math.sqrt(math.fsum(x * x for x in values)), 1e-12)
        values = [x / norm for x in values]
    return array("f", values).tolist()
