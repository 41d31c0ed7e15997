"""A hybrid-shaped GGUF file (LFM2-350M/700M, Qwen3.5-0.8B) with random weights, made the way a user's file is made: a Hugging Face directory
(random bfloat16 weights, SmolLM2's tokenizer), llama.cpp's own convert_hf_to_gguf.py to F16, then its
llama-quantize (default Q4_K_M). The input of `benchmarks/kquant.py --model FILE` for a hybrid.

    bash benchmarks/build_llama_server.sh          # once: llama-quantize, and the llama.cpp source it comes from
    python benchmarks/hybrid_gguf.py --shape 700m --out /tmp/lfm2-700m-q4_k_m.gguf
    python benchmarks/hybrid_gguf.py --shape qwen3.5-0.8b --out /tmp/qwen3.5-0.8b-q4_k_m.gguf
    python benchmarks/kquant.py --model /tmp/lfm2-700m-q4_k_m.gguf --parts memory,speed --runs 3

The converter is the one vendored in the llama-cpp-python sdist build_llama_server.sh unpacked (--llama-root).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hybrid_prefix import LFM2_350M, QWEN3_5_08B, random_model  # noqa: E402

# LFM2-700M's config.json shape: LFM2-350M's layers, wider
SHAPES = {"350m": LFM2_350M,
          "700m": {**LFM2_350M, "hidden_size": 1536, "block_ff_dim": 10240, "num_attention_heads": 24},
          "qwen3.5-0.8b": QWEN3_5_08B}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="700m")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-root", default="/work/peers/llama.cpp", help="build_llama_server.sh's OUT_DIR/..")
    args = ap.parse_args()
    root = Path(args.llama_root)
    sources = sorted(glob.glob(str(root / "src" / "*" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")))
    quantize = root / "bin" / "llama-quantize"
    if not sources or not quantize.is_file():
        raise SystemExit(f"no llama.cpp converter or llama-quantize under {root}: run benchmarks/build_llama_server.sh")
    converter = Path(sources[-1])
    from tests.models.tiny import smollm2_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(Path(tmp) / args.shape, SHAPES[args.shape])
        smollm2_tokenizer().save_pretrained(model)  # the converter reads the vocabulary from the directory
        f16 = Path(tmp) / "model-f16.gguf"
        env = {**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")}
        # a checkpoint without Qwen3.5's multi-token-prediction head: the converter asks to be told
        no_mtp = ["--no-mtp"] if args.shape.startswith("qwen") else []
        subprocess.run([sys.executable, str(converter), str(model), "--outfile", str(f16), "--outtype", "f16",
                        *no_mtp], env=env, check=True)
        subprocess.run([str(quantize), str(f16), args.out, args.type, "2"], check=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
