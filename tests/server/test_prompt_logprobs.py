"""/v1/completions and the prompt's logprobs, against a real `tokenmill serve` (conftest.py): vLLM's
`prompt_logprobs` list per choice, OpenAI's echo with logprobs (prompt tokens first, the first one null) whole and
streamed, and 400s for bad values."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.server.conftest import API_KEY

pytestmark = pytest.mark.slow

C = "/v1/completions"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def complete(http, **body) -> dict:
    r = http.post(C, json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(http) -> list[int]:
    return http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]


def test_vllm_prompt_logprobs(http):
    ids = prompt_ids(http)
    body = complete(http, prompt_logprobs=2, n=2, seed=1, temperature=0.8)
    for choice in body["choices"]:
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        for tid, entry in zip(ids[1:], plp[1:]):
            assert str(tid) in entry and 2 <= len(entry) <= 3
            assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())
            top = max(v["logprob"] for v in entry.values())
            assert entry[str(tid)]["logprob"] <= top
        assert choice["logprobs"] is None  # no logprobs asked for the completion
    assert body["choices"][0]["prompt_logprobs"] == body["choices"][1]["prompt_logprobs"]
    zero = complete(http, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert [list(e) for e in zero[1:]] == [[str(t)] for t in ids[1:]]
    for a, b in zip(zero[1:], body["choices"][0]["prompt_logprobs"][1:]):
        (tid, value), = a.items()
        assert value["logprob"] == pytest.approx(b[tid]["logprob"], abs=1e-4)
    assert "prompt_logprobs" not in complete(http)["choices"][0]


def test_echo_with_logprobs_leads_with_the_prompt(http):
    ids = prompt_ids(http)
    body = complete(http, echo=True, logprobs=1)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert choice["text"].startswith(PROMPT)
    assert "".join(lp["tokens"][:len(ids)]) == PROMPT
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # the same values as vLLM's prompt_logprobs
    plp = complete(http, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    for tid, value, entry in zip(ids[1:], lp["token_logprobs"][1:len(ids)], plp[1:]):
        assert value == pytest.approx(entry[str(tid)]["logprob"], abs=1e-4)
    # and streamed: the echo chunk carries them, ahead of the generated tokens
    with http.stream("POST", C, json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True,
                                      "logprobs": 1, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["tokens"] == lp["tokens"][:len(ids)]
    assert first["logprobs"]["token_logprobs"][0] is None
    streamed = [x for e in events for c in e["choices"] for x in (c["logprobs"] or {}).get("token_logprobs", [])]
    assert len(streamed) == n
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(streamed[1:], lp["token_logprobs"][1:]))


def test_chat_prompt_logprobs(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.json()["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 2 for entry in plp[1:])


@pytest.mark.parametrize("body,fragment", [
    ({"prompt_logprobs": 21}, "[0, 20]"),
    ({"prompt_logprobs": -1}, "[0, 20]"),
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ({"prompt_logprobs": 1.5}, "integer"),
])
def test_bad_values_are_400(http, body, fragment):
    r = http.post(C, json={"prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and fragment in err["message"] and err["type"]
