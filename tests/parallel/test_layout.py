"""How a model splits across tensor-parallel ranks: layouts refused with the fix named, each rank's share, and each
rank's slice of every checkpoint tensor (the slices put back together are the tensor)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.layout import ShardedCheckpoint, TPLayout, check_tensor_parallel

SMOLLM2 = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_layouts_the_model_cannot_take_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads; sizes that fit: 1, 3"):
        check_tensor_parallel(SMOLLM2, 2)
    gqa = ModelConfig("LlamaForCausalLM", 256, 64, 128, 2, num_heads=12, num_kv_heads=4, head_dim=8)
    with pytest.raises(ConfigError, match="neither divides the model's 4 KV heads nor is a multiple"):
        check_tensor_parallel(gqa, 6)
    mlp = ModelConfig("LlamaForCausalLM", 256, 64, 130, 2, num_heads=4, num_kv_heads=4, head_dim=16)
    with pytest.raises(ConfigError, match="130 intermediate columns"):
        check_tensor_parallel(mlp, 4)
    check_tensor_parallel(SMOLLM2, 3)
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be an integer"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="combine with --speculative-config"):
        EngineConfig(tensor_parallel_size=2, speculative={"method": "ngram"})


def test_each_rank_holds_its_share_and_kv_heads_are_replicated_past_their_count():
    shares = [TPLayout(SMOLLM2, 3, r) for r in range(3)]
    assert [(s.heads, s.kv_heads, s.kv_head_start, s.intermediate, s.vocab, s.vocab_start) for s in shares] == [
        (3, 1, 0, 512, 16384, 0), (3, 1, 1, 512, 16384, 16384), (3, 1, 2, 512, 16384, 32768)]
    shard = shares[1].shard_config()
    assert (shard.num_heads, shard.num_kv_heads, shard.head_dim, shard.hidden_size) == (3, 1, 64, 576)
    wide = ModelConfig("LlamaForCausalLM", 250, 64, 128, 2, num_heads=8, num_kv_heads=2, head_dim=8)
    assert [TPLayout(wide, 4, r).kv_head_start for r in range(4)] == [0, 0, 1, 1]  # 2 ranks per KV head
    assert TPLayout(wide, 4, 0).vocab == 63  # 250 rows over 4 ranks: 63 each, the last padded
    assert "(replicated)" in TPLayout(wide, 4, 0).describe()


@pytest.mark.parametrize("size,kvh", [(2, 2), (4, 2), (2, 4)])
def test_the_slices_of_every_tensor_put_back_together_are_the_tensor(size, kvh):
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=250, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=kvh, head_dim=8)
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    full = {f"{p}self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
            f"{p}self_attn.k_proj.weight": torch.randn(kvh * 8, 32, generator=g),
            f"{p}self_attn.v_proj.bias": torch.randn(kvh * 8, generator=g),
            f"{p}self_attn.o_proj.weight": torch.randn(32, 32, generator=g),
            f"{p}mlp.gate_proj.weight": torch.randn(48, 32, generator=g),
            f"{p}mlp.down_proj.weight": torch.randn(32, 48, generator=g),
            f"{p}input_layernorm.weight": torch.randn(32, generator=g),
            "model.embed_tokens.weight": torch.randn(250, 32, generator=g)}
    ranks = [ShardedCheckpoint(full, TPLayout(cfg, size, r)) for r in range(size)]
    assert set(ranks[0]) == set(full) and len(ranks[0]) == len(full)

    def joined(name: str, dim: int) -> torch.Tensor:
        return torch.cat([r[name] for r in ranks], dim)

    assert torch.equal(joined(f"{p}self_attn.q_proj.weight", 0), full[f"{p}self_attn.q_proj.weight"])
    assert torch.equal(joined(f"{p}self_attn.o_proj.weight", 1), full[f"{p}self_attn.o_proj.weight"])
    assert torch.equal(joined(f"{p}mlp.gate_proj.weight", 0), full[f"{p}mlp.gate_proj.weight"])
    assert torch.equal(joined(f"{p}mlp.down_proj.weight", 1), full[f"{p}mlp.down_proj.weight"])
    assert all(torch.equal(r[f"{p}input_layernorm.weight"], full[f"{p}input_layernorm.weight"]) for r in ranks)
    embed = joined("model.embed_tokens.weight", 0)
    assert torch.equal(embed[:250], full["model.embed_tokens.weight"]) and not embed[250:].any()
    k = [r[f"{p}self_attn.k_proj.weight"] for r in ranks]  # each rank's KV heads, in rank order
    starts = [TPLayout(cfg, size, r).kv_head_start for r in range(size)]
    for rank_k, start in zip(k, starts):
        assert torch.equal(rank_k, full[f"{p}self_attn.k_proj.weight"][start * 8:start * 8 + len(rank_k)])
    v = torch.cat([ranks[r][f"{p}self_attn.v_proj.bias"] for r in range(size) if size <= kvh or r % (size // kvh) == 0])
    assert torch.equal(v, full[f"{p}self_attn.v_proj.bias"])


def test_each_cuda_rank_gets_its_own_gpu_and_a_node_short_of_gpus_is_refused(monkeypatch):
    from tokenmill.parallel.group import rank_device

    assert rank_device("cpu", 3, 4) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [rank_device("cuda", r, 2) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert rank_device("cuda:1", 0, 2) == "cuda:1"  # a device named in full is used as it is
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="2 parallel ranks per node need as many GPUs, this node has 1"):
        rank_device("cuda", 1, 2)
