"""`tokenmill eval ppl`: the perplexity it reports is exp of the mean NLL that a transformers forward pass of the same
model gives on the same held-out samples; held-out and calibration text never overlap."""

from __future__ import annotations

import json
import math
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models.tiny import make_tiny_model
from tokenmill import cli
from tokenmill.eval import calibration_texts, heldout_samples, heldout_texts, perplexity
from tokenmill.tokenizer import Tokenizer

WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "quiet", "hills", "and", "rivers",
         "ran", "to", "seas", "far", "from", "every", "town", "people", "wrote", "code", "serve", "models", "faster"]


def synthetic_sharegpt(path, n: int = 40, seed: int = 0) -> None:
    """A small ShareGPT-shaped file: n conversations of random words, a few too short to score."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": text(rng.randint(3, 30))},
                                                  {"from": "gpt", "value": text(rng.randint(1, 60))}]}
               for i in range(n)]
    path.write_text(json.dumps(records))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "sharegpt.json"
    synthetic_sharegpt(path)
    return path


def test_halves_are_disjoint_and_seeded(dataset):
    cal, held = calibration_texts(1000, 0, dataset), heldout_texts(1000, 0, dataset)
    assert cal and held and not set(cal) & set(held)
    assert sorted(calibration_texts(1000, 1, dataset)) == sorted(cal)  # the seed shuffles, the half stays
    assert calibration_texts(1000, 1, dataset) != cal
    assert heldout_texts(3, 0, dataset) == held[:3]


@pytest.mark.slow
def test_real_sharegpt_halves_are_disjoint():
    cal, held = calibration_texts(2000, 0), heldout_texts(2000, 0)
    assert len(cal) == len(held) == 2000
    assert not set(cal) & set(held)


def test_bootstrap_interval_brackets_the_estimate():
    rng = random.Random(0)
    counts = [rng.randint(20, 60) for _ in range(50)]
    nlls = [c * rng.uniform(2.0, 3.0) for c in counts]
    ppl, mean, (lo, hi) = perplexity(nlls, counts)
    assert mean == pytest.approx(sum(nlls) / sum(counts)) and ppl == pytest.approx(math.exp(mean))
    assert lo < ppl < hi and hi / lo < 1.2
    assert perplexity(nlls, counts)[2] == (lo, hi)  # fixed seed


def test_cli_perplexity_matches_a_transformers_forward(tmp_path, dataset):
    model = make_tiny_model(tmp_path, num_kv_heads=2)  # SmolLM2's vocabulary, so text tokenizes
    out = tmp_path / "ppl.json"
    args = ["eval", "ppl", "--model", str(model), "--dtype", "float32", "--kv-cache-memory", "64MiB",
            "--dataset-path", str(dataset), "--num-samples", "8", "--max-tokens-per-sample", "40",
            "--seed", "3", "--json", str(out), "--no-progress", "--max-num-batched-tokens", "64"]
    assert cli.main(args) == 0
    result = json.loads(out.read_text())

    samples = heldout_samples(Tokenizer.load(model), 8, 3, 40, path=dataset)
    assert len(samples) == 8 and all(16 <= len(s) <= 40 for s in samples)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in samples:
            logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
            nll -= float(logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum())
            count += len(ids) - 1
    assert result["num_samples"] == 8 and result["num_tokens"] == count
    assert result["mean_nll"] == pytest.approx(nll / count, abs=1e-4)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    lo, hi = result["ci95"]
    assert lo <= result["perplexity"] <= hi
    assert result["config"]["dtype"] == "float32" and "quantization" in result["config"]
    assert result["elapsed_s"] > 0


def test_cli_refuses_bad_counts(capsys):
    assert cli.main(["eval", "ppl", "--num-samples", "0"]) == 2
    assert "--num-samples must be at least 1" in capsys.readouterr().err
