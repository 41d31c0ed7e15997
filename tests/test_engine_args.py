"""EngineArgs: one field is one CLI flag, one LLM keyword and one EngineConfig entry, validated at the edge."""

import dataclasses

import pytest

from tokenmill.cli import build_parser
from tokenmill.config import SpeculativeConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import ConfigError
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.server.multi_launch import split_models

# a non-default value per field, as typed on the command line and as it should arrive in the config
CHANGED = {"model": ("m.gguf", "m.gguf"), "tokenizer": ("tok", "tok"), "dtype": ("bfloat16", "bfloat16"),
           "device": ("meta", "meta"), "seed": ("7", 7), "num_threads": ("3", 3),
           "kv_cache_memory": ("1GiB", 1 << 30), "block_size": ("32", 32), "enable_prefix_caching": (None, False),
           "kv_cache_dtype": ("fp8", "fp8"), "disable_hybrid_kv_cache_manager": (True, True),
           "max_num_seqs": ("9", 9), "max_num_batched_tokens": ("1024", 1024),
           "long_prefill_token_threshold": ("100", 100), "max_model_len": ("4096", 4096),
           "scheduling_policy": ("static", "static"), "batch_invariant": (None, False),
           "quantization": ("int8", "int8"), "max_prefill_tokens_while_decoding": ("64", 64),
           "max_decode_slowdown": ("2.5", 2.5), "num_scheduler_steps": ("8", 8),
           "speculative_config": ('{"num_speculative_tokens": 3}', '{"num_speculative_tokens": 3}'),
           "priority_aging_s": ("5", 5.0), "new_token_ratio": ("0.5", 0.5), "slo_ttft_ms": ("800", 800.0),
           "slo_itl_ms": ("150", 150.0), "tensor_parallel_size": ("2", 2), "enable_expert_parallel": (True, True),
           "pipeline_parallel_size": ("2", 2), "pipeline_micro_batches": ("4", 4),
           "distributed_executor_backend": ("ray", "ray"),
           "context_parallel_size": ("2", 2),
           "nnodes": ("2", 2), "node_rank": ("1", 1), "master_addr": ("10.0.0.1", "10.0.0.1"),
           "master_port": ("29500", 29500),
           "kv_transfer_config": ('{"kv_connector": "shm", "kv_role": "kv_consumer"}',
                                  '{"kv_connector": "shm", "kv_role": "kv_consumer"}'),
           "enable_lora": (True, True), "max_loras": ("8", 8), "max_lora_rank": ("32", 32)}
# fields valid only beside others (two nodes need two ranks and a meeting port): those others, as fields
COMPANIONS = {"nnodes": {"tensor_parallel_size": 2, "master_port": 29500},
              "node_rank": {"nnodes": 2, "tensor_parallel_size": 2, "master_port": 29500}}
# where the config holds the field parsed: what it should hold
PARSED = {"speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
          "kv_transfer_config": KVTransferConfig(kv_connector="shm", kv_role="kv_consumer")}


def config_value(config, field: dataclasses.Field):
    section = {"engine": config, "cache": config.cache, "scheduler": config.scheduler}[field.metadata["config"]]
    return getattr(section, field.metadata["key"] or field.name)


def test_every_field_is_covered_here():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench offline"])
def test_defaults_are_the_same_everywhere(command):
    argv = command.split() + (["hello"] if command == "generate" else [])
    assert EngineArgs.from_cli_args(build_parser().parse_args(argv)) == EngineArgs()


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_each_flag_reaches_its_config_entry(name):
    typed, expected = CHANGED[name]
    flag = EngineArgs.flag_of(name)
    # typed None: a flag on by default, turned off; True: a flag off by default, turned on
    argv = (["serve", f"--no-{flag[2:]}"] if typed is None else ["serve", flag] if typed is True
            else ["serve", flag, typed])
    companions = COMPANIONS.get(name, {})
    for other, value in companions.items():
        argv += [EngineArgs.flag_of(other), str(value)]
    namespace = build_parser().parse_args(argv)
    split_models(namespace)  # serve's own step: one --model (repeatable there) becomes the engine's path
    args = EngineArgs.from_cli_args(namespace)
    assert getattr(args, name) == expected
    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == name)
    parsed = PARSED.get(name, expected)
    assert config_value(args.create_engine_config(), field) == parsed
    kwargs = {name: expected, **companions}
    assert config_value(EngineArgs(**kwargs).create_engine_config(), field) == parsed  # the LLM path


@pytest.mark.parametrize("kw,flag", [({"max_num_seqs": 0}, "--max-num-seqs"), ({"block_size": 0}, "--block-size"),
                                     ({"num_threads": 0}, "--threads"), ({"dtype": "int3"}, "--dtype"),
                                     ({"quantization": "int3"}, "--quantization"),
                                     ({"long_prefill_token_threshold": 0}, "--long-prefill-token-threshold"),
                                     ({"kv_transfer_config": '{"kv_role": "both"}'}, "--kv-transfer-config"),
                                     ({"kv_transfer_config": "{"}, "--kv-transfer-config"),
                                     ({"tensor_parallel_size": 0}, "--tensor-parallel-size"),
                                     ({"nnodes": 2, "tensor_parallel_size": 2}, "--master-port"),
                                     ({"nnodes": 2, "tensor_parallel_size": 3, "master_port": 1}, "--nnodes"),
                                     ({"node_rank": 1}, "--node-rank")])
def test_invalid_values_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(**kw).create_engine_config()


def test_llm_rejects_unknown_keywords_before_loading_anything():
    from tokenmill.llm import LLM

    with pytest.raises(TypeError, match="not_an_option"):
        LLM(not_an_option=1)
    with pytest.raises(TypeError, match="either engine_args"):
        LLM("m", engine_args=EngineArgs())
