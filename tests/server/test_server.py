"""End to end against a real `tokenmill serve` process (conftest.py) with the real default model, through the
official `openai` client and httpx: greedy parity of streaming and non-streaming, chat streaming shape, usage,
logprobs, 32 concurrent streams, disconnects freeing their blocks, every bad input's status and body, API key,
429 under a burst, graceful shutdown on SIGTERM, and a dead engine making the server exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def metrics(http) -> dict[str, float]:
    """Unlabelled view of /metrics: metric name -> value (summed over labels)."""
    out: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_idle(http, timeout: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["tokenmill_num_requests_running"] == 0 and m["tokenmill_kv_cache_usage_ratio"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.1)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---- basics ----------------------------------------------------------------------------------------------------


def test_models_health_and_version(server, client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    raw = http.get("/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 8192 and raw["object"] == "model"
    assert http.get(f"/v1/models/{server.model}").json()["id"] == server.model
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]


def test_completion_stream_and_non_stream_agree(client, http):
    kw = {"model": client.models.list().data[0].id, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == \
        (n_prompt, 24, n_prompt + 24)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"

    assert full.model == kw["model"]
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == choice.text and finish == "length"
    assert usage.completion_tokens == 24 and usage.prompt_tokens == n_prompt


def test_chat_stream_shape_and_parity(client):
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    msg = full.choices[0]
    assert msg.message.role == "assistant" and msg.message.content
    assert msg.finish_reason in ("stop", "length")
    if msg.finish_reason == "length":
        assert full.usage.completion_tokens == 20
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == msg.message.content and finishes == [msg.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_ends_with_stop_when_model_ends(client):
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=[
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": [{"type": "text", "text": "What colour is the sky?"}]}], max_tokens=200,
        temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "stop" and out.usage.completion_tokens < 200
    assert "<|im_end|>" not in c.message.content


def test_stop_string_n_seed_echo_and_prompt_forms(client, http):
    model = client.models.list().data[0].id
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    word = re.findall(r"\w{3,}", base)[1]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == base[: base.index(word)]
    assert cut.usage.completion_tokens < 24

    kw = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens <= 24 and len({c.text for c in a.choices}) > 1

    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPT)

    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == base
    many = client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=4, temperature=0,
                                     n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and many.usage.completion_tokens == 16


def test_logprobs(client):
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 2 <= len(top) <= 4 and max(top.values()) == pytest.approx(value)  # greedy: the top
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert isinstance(entry.bytes, list)
    streamed = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_logit_bias_bans_tokens_and_composes_with_structured_output(client, http):
    """-100 bans a token (greedy output moves off it; the ban holds on every step), +100 forces one; inside a choice
    constraint a ban picks the other choice."""
    model = client.models.list().data[0].id
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    first = http.post("/tokenize", json={"prompt": plain.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(first[0]): -100}, logprobs=0)
    ids = http.post("/tokenize", json={"prompt": banned.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    assert ids and ids[0] != first[0] and first[0] not in ids
    forced = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=1.0, seed=1,
                                       logit_bias={"1000": 100}, extra_body={"ignore_eos": True})
    assert http.post("/tokenize", json={"prompt": forced.choices[0].text, "add_special_tokens": False}).json()[
        "tokens"] == [1000] * 3
    choice = {"choice": ["Paris", "London"]}
    chosen = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       extra_body={"structured_outputs": choice}).choices[0].text
    assert chosen == "Paris"  # greedy picks Paris; banning its first token leaves London
    paris = http.post("/tokenize", json={"prompt": "Paris", "add_special_tokens": False}).json()["tokens"]
    other = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                      logit_bias={str(paris[0]): -100}, extra_body={"structured_outputs": choice})
    assert other.choices[0].text == "London"


def test_tokenize_detokenize(http):
    tok = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192 and len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tok["count"]


# ---- load, disconnects ----------------------------------------------------------------------------------------------


def test_32_concurrent_streams(server):
    async def one(c: httpx.AsyncClient, i: int):
        max_tokens = 4 + i % 13
        body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        finishes = [ch["finish_reason"] for e in events[:-1] for ch in e["choices"] if ch["finish_reason"]]
        return max_tokens, finishes, events[-2]["usage"]["completion_tokens"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    for max_tokens, finishes, used in asyncio.run(main()):
        assert finishes == ["length"] and used == max_tokens


def test_disconnect_aborts_and_frees_blocks(server, http):
    before = metrics(http)["tokenmill_request_aborts_total"]
    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        while got < 2:
            got += next(lines).startswith("data: ")
    m = wait_idle(http)
    assert m["tokenmill_request_aborts_total"] == before + 1
    assert m["tokenmill_num_requests_waiting"] == 0

    # non-streaming: the client gives up (timeout) and closes its connection
    body = {"messages": CHAT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=1.0)
    m = wait_idle(http)
    assert m["tokenmill_request_aborts_total"] == before + 2


def test_burst_over_the_waiting_limit_gets_429(server, http):
    wait_idle(http)

    async def one(c: httpx.AsyncClient, i: int):
        r = await c.post("/v1/completions", json={"prompt": f"Item {i}", "max_tokens": 16, "temperature": 0,
                                                   "ignore_eos": True})
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
        return r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300,
                                     limits=httpx.Limits(max_connections=120)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(110)))

    results = asyncio.run(main())
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 429} and codes.count(429) >= 1 and codes.count(200) >= 40, codes
    for code, body in results:
        if code == 429:
            assert body["error"]["type"] == "server_overloaded" and "--max-waiting-requests" in body["error"]["message"]
        else:
            assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16
    wait_idle(http)


# ---- bad input -----------------------------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
OK_C = {"prompt": "Hi", "max_tokens": 2}
OK_CH = {"messages": CHAT, "max_tokens": 2}

BAD = [  # (path, body, status, param or None, fragment of the message)
    (C, {**OK_C, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    (C, {**OK_C, "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    (CH, {**OK_CH, "max_completion_tokens": 0}, 400, "max_tokens", ">= 1"),
    (C, {**OK_C, "temperature": -0.1}, 400, "temperature", ">= 0"),
    (C, {**OK_C, "top_p": 0}, 400, "top_p", "(0, 1]"),
    (C, {**OK_C, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    (C, {**OK_C, "n": 0}, 400, "n", "[1, 64]"),
    (C, {**OK_C, "n": 65}, 400, "n", "[1, 64]"),
    (C, {**OK_C, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    (CH, {**OK_CH, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
    (CH, {**OK_CH, "messages": []}, 400, "messages", "empty"),
    (CH, {**OK_CH, "messages": "hello"}, 400, "messages", ""),
    (CH, {**OK_CH, "messages": [{"content": "hi"}]}, 400, "messages.0.role", "required"),
    (CH, {**OK_CH, "messages": [{"role": "user"}]}, 400, "messages.0.content", "required"),
    (CH, {**OK_CH, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "unknown role"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages.0.content",
     "not supported"),
    (C, {**OK_C, "prompt": [1, 2, 10**6]}, 400, "prompt", "outside the vocabulary"),
    (C, {**OK_C, "prompt": [1, -2]}, 400, "prompt", "outside the vocabulary"),
    (C, {**OK_C, "prompt": []}, 400, "prompt", "empty"),
    (C, {**OK_C, "prompt": ""}, 400, "prompt", "empty"),
    (C, {**OK_C, "max_tokens": 10**4}, 400, "max_tokens", "context window of 8192"),
    (C, {**OK_C, "prompt": [1] * 9000}, 400, "prompt", "context window is 8192"),
    (C, {**OK_C, "max_tokens": 8000}, 400, "max_tokens", "KV cache capacity"),
    (C, {**OK_C, "model": "gpt-9"}, 404, "model", "does not exist"),
    (CH, {**OK_CH, "model": "gpt-9"}, 404, "model", "does not exist"),
    (C, {**OK_C, "temperature": "hot"}, 400, "temperature", "valid number"),
    (C, {**OK_C, "seed": -1}, 400, "seed", ""),
    (C, {**OK_C, "stop": [""]}, 400, "stop", "non-empty"),
    (C, {**OK_C, "cache_salt": ""}, 400, "cache_salt", "non-empty"),
    (C, {**OK_C, "priority": "high"}, 400, "priority", "integer"),
    (C, {**OK_C, "priority": 10**9}, 400, "priority", "lower runs first"),
    (C, {**OK_C, "priority": -1}, 400, "priority", "--client-priority-range 0:"),  # a client cannot jump the queue
    (CH, {**OK_CH, "priority": -1000000}, 400, "priority", "--client-priority-range 0:"),
    (CH, {**OK_CH, "slo_ttft_ms": -5}, 400, "slo_ttft_ms", "positive"),
    (C, {**OK_C, "slo_itl_ms": 0}, 400, "slo_itl_ms", "positive"),
    (C, {**OK_C, "stop_token_ids": [10**7]}, 400, "stop_token_ids", "vocabulary"),
    (C, {**OK_C, "repetition_penalty": 1e-300}, 400, "repetition_penalty", ""),
    (C, {**OK_C, "presence_penalty": 3}, 400, "presence_penalty", ""),
    (C, {**OK_C, "prompt": ["a", "b"] * 25}, 400, "prompt", "--max-waiting-requests 48"),  # can never fit: not 429
    (C, {**OK_C, "prompt": ["a"] * 5, "n": 10}, 400, "n", "--max-waiting-requests 48"),
    (C, {**OK_C, "prompt": "\ud800"}, 400, "prompt", "surrogate"),
    (C, {**OK_C, "prompt": ["ok", "a\udfffb"]}, 400, "prompt.1", "surrogate"),
    (C, {**OK_C, "stop": ["\ud800"]}, 400, "stop.0", "surrogate"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages.0.content", "surrogate"),
    (CH, {**OK_CH, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, 400,
     "messages.0.content.0.text", "surrogate"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "surrogate"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content", "surrogate"),
    (C, {"max_tokens": 2}, 400, "prompt", "required"),
    (C, [1, 2], 400, None, "JSON object"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", "vocabulary"),
]


def check_error(r: httpx.Response, status: int, param=None, fragment: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and fragment in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serves(http) -> None:
    r = http.post(C, json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path,body,status,param,fragment", BAD, ids=[f"{i}-{b[0].rsplit('/', 1)[1]}"
                                                                      for i, b in enumerate(BAD)])
def test_bad_input(http, path, body, status, param, fragment):
    # json.dumps escapes lone surrogates as \\uD800 (valid JSON), where httpx's json= cannot encode them
    check_error(http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"}), status,
                param, fragment)
    still_serves(http)


def test_bad_transport(server, http):
    url = server.url + C
    h = server.headers
    check_error(httpx.post(url, content=b"{not json", headers={**h, "Content-Type": "application/json"}), 400,
                None, "not valid JSON")
    check_error(httpx.post(url, content=json.dumps(OK_C), headers={**h, "Content-Type": "text/plain"}), 400,
                None, "Content-Type")
    check_error(httpx.post(url, content=json.dumps(OK_C), headers=h), 400, None, "Content-Type")  # none at all
    check_error(httpx.post(url, content=b'{"prompt": "Hi", "temperature": NaN}',
                           headers={**h, "Content-Type": "application/json"}), 400, "temperature")
    raw_surrogate = b'{"prompt": "a\xed\xa0\x80", "max_tokens": 1}'  # a surrogate as UTF-8-style bytes: no escape
    check_error(httpx.post(url, content=raw_surrogate, headers={**h, "Content-Type": "application/json"}), 400,
                "prompt", "surrogate")
    check_error(httpx.post(url, content='{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"),
                           headers={**h, "Content-Type": "application/json"}), 400, None, "UTF-8")
    check_error(httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000,
                           headers={**h, "Content-Type": "application/json"}), 400, None, "not valid JSON")
    check_error(httpx.post(url, json={"prompt": "x" * (2 << 20)}, headers=h), 413, None, "--max-request-bytes")

    def chunked():
        for _ in range(40):
            yield b"x" * 65536

    check_error(httpx.post(url, content=chunked(), headers={**h, "Content-Type": "application/json"}), 413)
    check_error(httpx.post(url, json=OK_C), 401, None, "missing API key")
    check_error(httpx.post(url, json=OK_C, headers={"Authorization": "Bearer nope"}), 401, None, "invalid API key")
    check_error(httpx.get(server.url + "/v1/models"), 401)
    check_error(http.get("/v1/nothing-here"), 404)
    check_error(http.get(C), 405)
    still_serves(http)


def test_openai_client_sees_typed_errors(server, client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_extreme_but_valid_values_do_not_break_the_engine(http):
    for extra in ({"top_k": 10**30}, {"temperature": 1e-300}, {"temperature": 100, "top_p": 1e-9},
                  {"min_p": 1.0, "temperature": 1.0}, {"repetition_penalty": 100, "temperature": 1.0},
                  {"seed": 2**63 - 1, "temperature": 1.0}, {"seed": 2**63 - 2, "n": 2, "temperature": 1.0}, {"stop": ["a"] * 64}):
        r = http.post(C, json={**OK_C, **extra})
        assert r.status_code == 200, (extra, r.text)
    still_serves(http)


def test_parameters_that_crashed_the_engine_now_get_a_token(server, http):
    """Issue 11: top_p that rounds to 0 in float32 and a min_tokens mask over the whole vocabulary each made
    torch.multinomial raise in the engine process, and the server exited 1."""
    vocab_size = 49152  # SmolLM2
    for extra in ({"temperature": 1, "top_p": 1e-46}, {"temperature": 1, "top_p": 5e-324, "min_p": 1.0},
                  {"temperature": 1, "min_tokens": 1, "stop_token_ids": list(range(vocab_size))},
                  {"temperature": 0, "min_tokens": 2, "stop_token_ids": list(range(vocab_size))}):
        r = http.post(C, json={**OK_C, **extra})
        assert r.status_code == 200, (list(extra), r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert server.proc.poll() is None and http.get("/health").status_code == 200
    still_serves(http)


def test_surrogate_keeps_the_connection_usable(server):
    """A 400 for invalid text leaves the keep-alive connection open for the next request (a 500 used to drop it)."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        first = c.post(C, content=b'{"prompt": "\\ud800", "max_tokens": 1}',
                       headers={"Content-Type": "application/json"})
        check_error(first, 400, "prompt", "surrogate")
        assert first.headers.get("connection", "").lower() != "close"
        second = c.post(C, json={"prompt": "Hi", "max_tokens": 1})
        assert second.status_code == 200
    assert "Traceback" not in server.stderr()


def raw_http(server, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes to the server; return (status, headers, body) of its answer."""
    import socket

    host, port = server.url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: banana\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",
    b"BLAH\r\n\r\n",
], ids=["content-length-text", "content-length-negative", "no-colon", "nul", "no-host", "no-request-line"])
def test_malformed_http_gets_a_json_400(server, request_bytes):
    status, headers, body = raw_http(server, request_bytes)
    assert status == 400 and headers["content-type"] == "application/json", (status, headers, body)
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_priorities_and_targets_are_served_and_measured(http):
    r = http.post(C, json={**OK_C, "priority": 3, "slo_ttft_ms": 60000, "slo_itl_ms": 60000})
    assert r.status_code == 200
    text = http.get("/metrics").text
    assert 'tokenmill_time_to_first_token_by_priority_seconds_count{model_name=' in text
    assert 'priority="3"' in text
    assert m_value(text, 'tokenmill_slo_requests_total', 'outcome="met",priority="3"') >= 1


def m_value(text: str, name: str, labels: str) -> float:
    line = next((ln for ln in text.splitlines() if ln.startswith(name) and labels in ln), None)
    assert line is not None, [ln for ln in text.splitlines() if ln.startswith(name)]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in ("tokenmill_requests_total", "tokenmill_prompt_tokens_total", "tokenmill_generation_tokens_total",
                 "tokenmill_time_to_first_token_seconds_bucket", "tokenmill_inter_token_latency_seconds_bucket",
                 "tokenmill_e2e_request_latency_seconds_bucket", "tokenmill_request_queue_time_seconds_bucket",
                 "tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_num_waiting_tokens",
                 "tokenmill_kv_cache_usage_ratio", "tokenmill_num_preemptions_total",
                 "tokenmill_request_aborts_total", "tokenmill_prefill_tokens_computed_total",
                 "tokenmill_prefix_cache_queries_total",
                 "tokenmill_prefix_cache_hits_total", "tokenmill_prefix_cache_hit_ratio", "tokenmill_prefix_cache_blocks",
                 "tokenmill_prefix_cache_evicted_blocks_total", "tokenmill_leaked_blocks"):
        assert name in text, name
    m = metrics(http)
    assert m["tokenmill_generation_tokens_total"] > 0 and m["tokenmill_prompt_tokens_total"] > 0
    assert m["tokenmill_leaked_blocks"] == 0


def test_metrics_say_the_weights_and_the_kv_cache_as_the_start_up_log_does(server, http):
    """The weight format and bytes and the KV cache's bytes in /metrics are the ones the engine printed at start-up
    (and no recurrent state for a model without state layers)."""
    import re

    logged = re.search(r"weights: (.+), (\d+) MiB", server.stderr())
    assert logged, server.stderr()
    line = next(line for line in http.get("/metrics").text.splitlines()
                if line.startswith("tokenmill_model_weight_bytes{"))
    assert f'format="{logged.group(1)}"' in line
    assert round(float(line.rsplit(" ", 1)[1]) / 2**20) == int(logged.group(2))
    kv = re.search(r"KV cache: .*, (\d+) MiB;", server.stderr())
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
              if line.startswith(("tokenmill_kv_cache_bytes{", "tokenmill_recurrent_state"))}
    assert kv and round(gauges["tokenmill_kv_cache_bytes"] / 2**20) == int(kv.group(1))
    assert gauges["tokenmill_recurrent_state_slots"] == gauges["tokenmill_recurrent_state_snapshots"] == 0  # no state


def test_prefix_cache_shares_a_system_prompt_but_not_across_salts(server, http):
    assert "prefix caching on" in server.stderr()
    system = {"role": "system", "content": "You are a terse assistant for a shipping company. " * 12}
    ask = [system, {"role": "user", "content": "Where is my parcel?"}]

    def chat(messages, **extra):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0,
                                                     **extra})
        assert r.status_code == 200, r.text
        return r.json()

    wait_idle(http)
    first = chat([system, {"role": "user", "content": "Hello."}])
    m0 = metrics(http)
    prompt_tokens = first["usage"]["prompt_tokens"]
    shared = chat(ask)
    m1 = metrics(http)
    assert m1["tokenmill_prefix_cache_hits_total"] - m0["tokenmill_prefix_cache_hits_total"] >= prompt_tokens - 32
    salted = chat(ask, cache_salt=f"tenant-{time.monotonic_ns()}")  # a fresh namespace: nothing to share
    m2 = metrics(http)
    assert m2["tokenmill_prefix_cache_hits_total"] == m1["tokenmill_prefix_cache_hits_total"]
    assert m2["tokenmill_prefix_cache_queries_total"] > m1["tokenmill_prefix_cache_queries_total"]
    assert shared["choices"][0]["message"] == salted["choices"][0]["message"]  # same greedy answer either way
    assert shared["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 32
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stream = http.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 4, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    usage = [e for e in sse_events(stream.text.splitlines()) if e != "[DONE]" and e.get("usage")][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 32
    assert 0 < m2["tokenmill_prefix_cache_hit_ratio"] < 1 and m2["tokenmill_prefix_cache_blocks"] > 0
    wait_idle(http)


# ---- shutdown, engine death (last: they end their servers) ------------------------------------------------------------


def test_sigterm_finishes_in_flight_and_exits_0(server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        events = sse_events([next(lines), *lines])
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 24
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)
    assert server.proc.wait(90) == 0, server.stderr()


def test_sigterm_past_the_shutdown_timeout_ends_requests_with_503():
    """Requests still running when --shutdown-timeout runs out end with a JSON 503 or a stream's error event and
    [DONE]; no plain-text 500, no cut stream, no CancelledError traceback."""
    srv = start_server("--shutdown-timeout", "1", api_key=None)
    try:
        long = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def streamed():
                    async with c.stream("POST", C, json={**long, "stream": True}) as r:
                        return r.status_code, sse_events([line async for line in r.aiter_lines()])

                async def plain():
                    r = await c.post(C, json=long)
                    return r.status_code, r.headers.get("content-type"), r.json()

                tasks = [asyncio.ensure_future(streamed()), asyncio.ensure_future(plain())]
                await asyncio.sleep(2.0)  # both running
                srv.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        (s_status, events), (p_status, p_type, p_body) = asyncio.run(main())
        assert s_status == 200 and events[-1] == "[DONE]", events[-3:]
        assert events[-2]["error"]["code"] == "server_shutting_down", events[-2]
        assert p_status == 503 and p_type == "application/json", (p_status, p_body)
        assert p_body["error"]["code"] == "server_shutting_down" and "--shutdown-timeout" in p_body["error"]["message"]
        assert srv.proc.wait(60) == 0, srv.stderr()
        log = srv.stderr()
        assert "CancelledError" not in log and "Traceback" not in log, log
    finally:
        srv.stop()


def test_engine_death_fails_requests_and_exits_nonzero():
    srv = start_server("--kv-cache-memory", "64MiB", api_key=None)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(srv.engine_pid(), signal.SIGKILL)
            events = sse_events(list(lines))
        # /health is truthful until the process exits: 503 while it answers, never 200
        while srv.proc.poll() is None:
            try:
                assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        assert events[-2]["error"]["code"] == "engine_dead"
        assert srv.proc.wait(30) != 0
        assert "engine process exited" in srv.stderr()
    finally:
        srv.stop()
