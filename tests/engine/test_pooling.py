"""Embedding requests (SamplingParams.pooling; runner.py `_pooled`, engine/pooling.py, LLM.embed): the final hidden
states pooled equal transformers' last_hidden_state pooled the same way (float32, within 2e-5); the same text gives
the same vector bit for bit whatever it is batched with and however its prompt is chunked or recomputed; such a
request samples nothing and leaves no KV behind, cached or held."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(10, 90)), [42], list(range(200, 20, -3))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pooling"), vocab_size=256)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooled_hidden_states_are_transformers(model_dir, llm, pooling, normalize):
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], pooling=pooling, normalize=normalize,
                    use_tqdm=False)
    for ids, vector in zip(PROMPTS, got):
        with torch.no_grad():
            states = hf(torch.tensor([ids])).last_hidden_state[0]
        want = states[-1] if pooling == "last" else states.mean(0)
        if normalize:
            want = F.normalize(want, dim=0)
        torch.testing.assert_close(torch.tensor(vector), want, atol=2e-5, rtol=2e-5)
    llm.engine.core.check_idle_invariants()


def test_same_text_same_vector_whatever_the_batch_or_chunks(model_dir, llm):
    alone = {p: llm.embed([{"prompt_token_ids": PROMPTS[1]}], pooling=p, use_tqdm=False)[0] for p in ("last", "mean")}
    crowd = [{"prompt_token_ids": p} for p in PROMPTS * 3]
    chunked = LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=24)
    tight = LLM(str(model_dir), dtype="float32", kv_cache_memory=8 * 16 * 1024, max_num_batched_tokens=32)  # 8 blocks
    for pooling, vector in alone.items():  # PROMPTS[1] is at 1, 5 and 9 in the crowd
        assert llm.embed(crowd, pooling=pooling, use_tqdm=False)[1] == vector
        assert chunked.embed(crowd, pooling=pooling, use_tqdm=False)[5] == vector
        assert tight.embed(crowd, pooling=pooling, use_tqdm=False)[9] == vector
    for engine in (llm, chunked, tight):
        engine.engine.core.check_idle_invariants()


def test_an_embedding_samples_nothing_and_leaves_no_kv(llm):
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1, pooling="mean"),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop" and len(out.embedding) == 64
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2, temperature=0),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # nothing of the embedding's prompt was cached
    repeat = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2, temperature=0),
                          use_tqdm=False)[0]
    assert repeat.num_cached_tokens > 0  # while a generated prompt is
    llm.engine.core.check_idle_invariants()


def test_a_chunk_from_the_start_drops_an_earlier_sum():
    """After a preemption the prompt is computed again from position 0: the sum starts over (runner `_pooled`),
    and chunk by chunk it is the one-pass sum exactly."""
    from tokenmill.engine.runner import ModelRunner
    from tokenmill.engine.step_types import ScheduledRequest
    from tokenmill.request import Request

    hidden = torch.randn(10, 8)
    req = Request("r", list(range(10)), SamplingParams(max_tokens=1, pooling="mean"), max_tokens=1)
    req.pooled = [123.0] * 8  # left from before a preemption
    first = ModelRunner._pooled(hidden[:6], [ScheduledRequest(req, 6)])["r"]
    assert first == hidden[:6].double().cumsum(0)[-1].tolist()
    req.pooled, req.num_computed_tokens = first, 6
    assert ModelRunner._pooled(hidden[6:], [ScheduledRequest(req, 4)])["r"] == hidden.double().cumsum(0)[-1].tolist()
    last = Request("l", list(range(10)), SamplingParams(max_tokens=1, pooling="last"), max_tokens=1)
    assert ModelRunner._pooled(hidden[:6], [ScheduledRequest(last, 6)]) == {}  # the last token is not in it yet
    last.num_computed_tokens = 6
    assert ModelRunner._pooled(hidden[6:], [ScheduledRequest(last, 4)])["l"] == hidden[9].double().tolist()


def test_a_base_model_checkpoint_serves_embeddings_only(tmp_path):
    """A Qwen3Model directory (an embedding checkpoint's form: no LM head, weights named without "model."): its
    embeddings are transformers' AutoModel's, and asking it for text is a 400 naming why."""
    import json

    from safetensors.torch import load_file, save_file

    from tokenmill.errors import InvalidRequest

    path = make_tiny_model(tmp_path, arch="qwen3", vocab_size=256, tie_word_embeddings=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3Model"]}))
    weights = load_file(path / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"},
              path / "model.safetensors")
    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    got = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[:2]], pooling="last", use_tqdm=False)
    for ids, vector in zip(PROMPTS[:2], got):
        with torch.no_grad():
            want = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)
        torch.testing.assert_close(torch.tensor(vector), want, atol=2e-5, rtol=2e-5)
    with pytest.raises(InvalidRequest, match="Qwen3Model"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_pooling_is_refused_under_context_parallelism():
    from tokenmill.engine.admission import check_pooling
    from tokenmill.errors import InvalidRequest

    check_pooling(1, SamplingParams(pooling="mean"))
    check_pooling(2, SamplingParams())
    with pytest.raises(InvalidRequest, match="context parallelism"):
        check_pooling(2, SamplingParams(pooling="last"))
