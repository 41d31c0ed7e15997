"""A second chat turn on a hybrid model (LFM2-350M's or Qwen3.5-0.8B's shape, random weights, bfloat16) against the
same model with every layer attention, in one run: the second turn resends the first with its answer, and prefix caching should
cover it on both (the hybrid's convolution state from a snapshot at the first turn's last block boundary).

    python benchmarks/hybrid_prefix.py                 # 3 ShareGPT conversations, defaults below
    python benchmarks/hybrid_prefix.py --conversations 5 --first-len 1024
    python benchmarks/hybrid_prefix.py --family qwen3.5

Per conversation: turn 1 is the conversation's opening text cut to --first-len tokens, answered with --answer-len
tokens (greedy, ignore_eos); turn 2 is turn 1, its answer and the next --next-len tokens of the conversation. Its
TTFT is measured cold (under a fresh cache salt: nothing cached) and warm (turn 1's salt), one request at a time,
and its hit rate is the share of its prompt the prefix cache held. Reported: medians over the conversations, the
warm / cold TTFT ratio and the hit rates; results/hybrid_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.datasets import iter_sharegpt_records, sharegpt_path  # noqa: E402
from tokenmill.model.checkpoint import expected_shapes  # noqa: E402
from tokenmill.model.cpu_kernels import cpu_isa  # noqa: E402
from tokenmill.model.loader import default_model_path  # noqa: E402
from tokenmill.model_config import ModelConfig  # noqa: E402
from tokenmill.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# LFM2-350M's config.json shape: 16 layers, attention at 2, 5, 8, 10, 12, 14, the rest short convolutions
LFM2_350M = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 65536, "hidden_size": 1024,
             "block_ff_dim": 6656, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
             "block_multiple_of": 256, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
             "conv_L_cache": 3, "conv_bias": False, "norm_eps": 1e-5, "max_position_embeddings": 128000,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_embedding": True,
             "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]}

# Qwen3.5-0.8B's text model (its config.json's text_config): 24 layers, every 4th gated attention (8 heads of 256,
# 2 KV heads, rotary on a quarter), the rest Gated DeltaNet (16 key and 16 value heads of 128), tied embeddings
QWEN3_5_08B = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
               "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
               "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
               "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": True,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10]}}
SHAPES = {"lfm2": ("LFM2-350M", LFM2_350M), "qwen3.5": ("Qwen3.5-0.8B", QWEN3_5_08B)}


def random_model(path: Path, cfg: dict) -> Path:
    """A model directory with random bfloat16 weights of `cfg`'s shape (norms near 1, the rest scaled by fan-in)."""
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in expected_shapes(ModelConfig.from_hf_dict(cfg)).items():
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * torch.randn(shape, generator=gen)).bfloat16()
        else:
            weights[name] = (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return path


def conversations(n: int, first_len: int, next_len: int) -> list[tuple[list[int], list[int]]]:
    """(turn 1's tokens, the next message's tokens) of the first `n` ShareGPT conversations long enough."""
    tok = Tokenizer.load(default_model_path())
    out = []
    for record in iter_sharegpt_records(sharegpt_path()):
        text = "\n".join(turn.get("value", "") for turn in record.get("conversations", []))
        ids = tok.encode(text)
        if len(ids) >= first_len + next_len:
            out.append((ids[:first_len], ids[first_len:first_len + next_len]))
        if len(out) == n:
            break
    return out


def ttft(llm: LLM, prompt: list[int], salt: str) -> tuple[float, int]:
    """Seconds to the first token of `prompt` alone (one token asked), and the prompt tokens the cache held."""
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}],
                       SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def run_model(path: Path, convs: list, answer_len: int, memory: int) -> dict:
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory=memory, tokenizer=str(default_model_path()),
              max_num_seqs=8)
    ttft(llm, convs[0][0][:64], "warm-up")
    rows = []
    for i, (first, following) in enumerate(convs):
        answer = llm.generate([{"prompt_token_ids": first, "cache_salt": f"c{i}"}],
                              SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
        second = first + answer + following
        cold, _ = ttft(llm, second, f"cold{i}")
        warm, cached = ttft(llm, second, f"c{i}")
        rows.append({"cold_s": cold, "warm_s": warm, "hit_rate": cached / len(second), "prompt": len(second)})
        print(f"  {path.name} conversation {i}: {len(second)} tokens, cold {cold * 1e3:.0f} ms, "
              f"warm {warm * 1e3:.0f} ms, hit {cached / len(second):.3f}", flush=True)
    llm.engine.core.check_idle_invariants()
    return {"cold_ms": statistics.median(r["cold_s"] for r in rows) * 1e3,
            "warm_ms": statistics.median(r["warm_s"] for r in rows) * 1e3,
            "ratio": statistics.median(r["warm_s"] / r["cold_s"] for r in rows),
            "hit_rate": statistics.median(r["hit_rate"] for r in rows), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=sorted(SHAPES), default="lfm2")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--first-len", type=int, default=768)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--next-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    args = ap.parse_args()
    convs = conversations(args.conversations, args.first_len, args.next_len)
    shape, hybrid = SHAPES[args.family]
    attention = {**hybrid, "layer_types": ["full_attention"] * hybrid["num_hidden_layers"]}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in (("hybrid", hybrid), ("attention", attention)):
            print(f"{name}: building a random {shape}-shaped model", flush=True)
            results[name] = run_model(random_model(Path(tmp) / f"{args.family}-{name}", cfg), convs,
                                      args.answer_len, args.kv_cache_memory)
    print(f"\n## second chat turn, {shape} shape, bfloat16, median of {len(convs)} conversations "
          f"(CPU {cpu_isa()})\n")
    print("| model | turn 2 tokens | cold TTFT ms | warm TTFT ms | warm / cold | hit rate |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        tokens = statistics.median(row["prompt"] for row in r["rows"])
        print(f"| {name} | {tokens:.0f} | {r['cold_ms']:.0f} | {r['warm_ms']:.0f} | {r['ratio']:.3f} | "
              f"{r['hit_rate']:.3f} |")
    out = ROOT / "benchmarks" / "results" / ("hybrid_prefix.json" if args.family == "lfm2"
                                             else f"hybrid_prefix_{args.family}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_isa(), "args": vars(args), "results": results}, indent=1))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
