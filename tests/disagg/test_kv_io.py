"""A sequence's KV written into a cache's pages at a token range reads back unchanged, token-major, and touches
no other slot."""

from __future__ import annotations

import torch

from tokenmill.disagg.kv_io import read_tokens, write_tokens
from tokenmill.disagg.transfer import TransferLayout
from tokenmill.engine.cache_tensors import CacheTensors
from tokenmill.engine.kv_layout import KVLayout

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 16, 4, 2, 8


def test_write_tokens_then_read_tokens_round_trips_a_token_range():
    cache = CacheTensors(KVLayout.uniform(LAYERS, BLOCK), (BLOCKS, BLOCK, HEADS, DIM), torch.float32,
                         torch.device("cpu"))
    layout = TransferLayout(LAYERS, HEADS, DIM, "float32", 4)
    gen = torch.Generator().manual_seed(1)
    for k, v in cache.per_layer:  # something to keep where nothing is written
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [(k.clone(), v.clone()) for k, v in cache.per_layer]
    blocks = [12, 13, 14]
    kv = torch.randn(6, LAYERS, 2, HEADS, DIM, generator=gen)
    write_tokens(cache, layout, blocks, 3, kv)
    back = read_tokens(cache, layout, blocks, 3, 9)
    assert back.shape == kv.shape and back.device.type == "cpu"
    torch.testing.assert_close(back, kv, rtol=0, atol=0)
    torch.testing.assert_close(cache.per_layer[1][1][12, 3], kv[0, 1, 1], rtol=0, atol=0)  # token 3: block 0
    torch.testing.assert_close(cache.per_layer[0][0][14, 0], kv[5, 0, 0], rtol=0, atol=0)  # token 8: block 2
    written = {(12, 3), (13, 0), (13, 1), (13, 2), (13, 3), (14, 0)}
    for (k, v), (k0, v0) in zip(cache.per_layer, before):
        for b in range(BLOCKS):
            for o in range(BLOCK):
                if (b, o) not in written:
                    assert torch.equal(k[b, o], k0[b, o]) and torch.equal(v[b, o], v0[b, o])
