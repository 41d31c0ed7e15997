"""Round-to-nearest INT4 (tokenmill/quant/int4.py): groups of 32 as Q4_1 blocks, served by the kept-GGUF kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from tests.quant.common import KV, tiny_batch_and_dense
from tokenmill import LLM
from tokenmill.formats.gguf_blocks import dequantize
from tokenmill.model.cpu_kernels import _extension
from tokenmill.quant.int4 import quantize_q4_1

ops = _extension()
KEPT = ops is not None and ops.gguf_kernel() != ""  # AMX tiles or AVX512-VNNI


def test_quantize_q4_1_writes_valid_blocks_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[5, :32] = 0.25  # a constant group: d = 0, every weight exactly its minimum
    blocks = quantize_q4_1(w)
    assert blocks.shape == (48, 4 * 20) and blocks.dtype == torch.uint8
    ours = dequantize(blocks, T.Q4_1, (48, 128))
    theirs = torch.from_numpy(np.ascontiguousarray(quants.dequantize(blocks.numpy(), T.Q4_1))).view(48, 128)
    assert torch.equal(ours, theirs)  # llama.cpp's reading of the bytes is ours
    groups = w.view(48, 4, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    assert ((ours - w).abs().view(48, 4, 32) <= step.unsqueeze(-1) * 0.5 + 1e-3 * w.abs().max()).all()
    assert torch.allclose(ours[5, :32], torch.full((32,), 0.25))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not KEPT, reason="the kept-block kernel runs on AMX or AVX512-VNNI"))])
def test_int4_model_runs_kept_blocks_and_tracks_the_dense_model(tmp_path, dtype):
    path, batch, params, dense = tiny_batch_and_dense(tmp_path, dtype, max_tokens=6)
    llm = LLM(path, dtype=dtype, quantization="int4", kv_cache_memory=KV)
    model = llm.engine.core.runner.model
    assert "int4" in llm.engine.core.runner.weight_summary()
    assert all(m.gguf_type == int(T.Q4_1) for m in model.linear_layers())
    assert model.embed_tokens.weight.is_meta  # the tied table's lookups read the head's blocks
    out = llm.generate(batch, params, use_tqdm=False)
    for a, b in zip(dense, out):
        ta, tb = a.outputs[0], b.outputs[0]
        assert abs(ta.logprobs[0][ta.token_ids[0]] - tb.logprobs[0][ta.token_ids[0]]) < 0.5
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch]
    assert alone == [o.outputs[0].token_ids for o in out]
    llm.engine.core.check_idle_invariants()
