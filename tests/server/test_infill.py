"""`suffix` on /v1/completions: fill-in-the-middle prompts for models with FIM tokens (tokenizer.py `infill`:
[BOS] <prefix> prefix <suffix> suffix <middle>), a 400 naming the model for one without them. The FIM model here is
a tiny random Llama whose tokenizer (SmolLM2's) carries Qwen2.5-Coder's three FIM tokens as added tokens (the
default model's refusal: tests/server/test_sdk_routes.py)."""

from __future__ import annotations

import copy

import httpx
import pytest

from tests.models.tiny import make_tiny_model, smollm2_tokenizer
from tests.server.conftest import API_KEY, start_server
from tokenmill.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fim"), vocab_size=49216)
    tok = copy.deepcopy(smollm2_tokenizer())  # the shared one is cached for every test: change a copy
    tok.add_special_tokens({"additional_special_tokens": FIM})
    tok.save_pretrained(path)
    return path


def test_infill_prompt_is_prefix_suffix_middle(fim_model):
    tok = Tokenizer.load(fim_model)
    pre, suf, mid = tok.fim_token_ids
    assert [tok.convert_ids_to_tokens([i])[0] for i in (pre, suf, mid)] == FIM
    ids = tok.infill("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    head = [tok.bos_token_id] if tok.encode("x")[:1] == [tok.bos_token_id] else []
    assert ids == [*head, pre, *tok.encode("def add(a, b):\n    return ", False), suf,
                   *tok.encode("\n\nprint(add(1, 2))", False), mid]


def test_suffix_is_served_for_text_prompts(fim_model):
    server = start_server("--model", str(fim_model), "--served-model-name", "fim")
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
            body = {"model": "fim", "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))",
                    "max_tokens": 4, "temperature": 0, "echo": True}
            out = http.post("/v1/completions", json=body)
            assert out.status_code == 200, out.text
            want = Tokenizer.load(fim_model).infill(body["prompt"], body["suffix"])
            assert out.json()["usage"]["prompt_tokens"] == len(want)
            assert out.json()["choices"][0]["text"].startswith(body["prompt"])  # echo: the prefix, as sent
            ids = http.post("/v1/completions", json={**body, "prompt": [1, 2, 3]})
            assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"
    finally:
        server.stop()
