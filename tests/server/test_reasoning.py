"""Reasoning parsers (server/reasoning.py) and chat_template_kwargs: the split of whole texts and of deltas at every
split point, the reasoning token count, the kwargs' checks and rendering; then through real servers with the openai
client: SmolLM2 under --reasoning-parser deepseek_r1 and a tiny model with a template of its own under qwen3, each
driven by a regex constraint so the output holds think tags deterministically."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, start_server
from tokenmill.errors import InvalidRequest
from tokenmill.server.reasoning import ReasoningStream, split_reasoning
from tokenmill.server.settings import ServerSettings, check_template_kwargs, parse_template_kwargs_flag

# (parser, output, reasoning (None: no block), content)
CASES = [
    ("deepseek_r1", "abc</think>def", "abc", "def"),
    ("deepseek_r1", "<think>abc</think>def", "abc", "def"),
    ("deepseek_r1", "thinking, never closed", "thinking, never closed", ""),
    ("deepseek_r1", "", "", ""),
    ("deepseek_r1", "<thinker>x</think>y", "<thinker>x", "y"),
    ("deepseek_r1", "a </thi", "a </thi", ""),
    ("deepseek_r1", "a</think>b</think><think>c", "a", "b</think><think>c"),
    ("deepseek_r1", "<think>", "", ""),
    ("qwen3", "<think>abc</think>def", "abc", "def"),
    ("qwen3", "<think>\n\n</think>\n\nHello there", "\n\n", "\n\nHello there"),
    ("qwen3", "a plain answer", None, "a plain answer"),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "pre <think>r</think> post", "r", "pre  post"),
    ("qwen3", "x </think> y", None, "x </think> y"),
    ("qwen3", "ends with <thin", None, "ends with <thin"),
    ("qwen3", "<<think>r</think>>", "r", "<>"),
    ("qwen3", "", None, ""),
]


def streamed(parser: str, parts: list[str]) -> tuple[str, str, list]:
    stream = ReasoningStream(parser)
    pieces = [p for part in parts for p in stream.feed(part)] + stream.finish()
    return ("".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "content"),
            pieces)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_text_split(parser, text, reasoning, content):
    assert split_reasoning(parser, text)[:2] == (reasoning, content)
    assert split_reasoning(parser, [text[:3], text[3:]])[:2] == (reasoning, content)


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_streamed_split_agrees_at_every_split_point(parser, text, reasoning, content):
    """Two and three deltas cut anywhere, and one character at a time: the same split, tags never shown."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    cuts.append(list(text))
    for parts in cuts:
        r, c, pieces = streamed(parser, parts)
        assert (r, c) == (reasoning or "", content), parts
        assert all(text for _, text in pieces)  # no empty pieces
        if "<think>" not in (reasoning or "") + content and "</think>" not in (reasoning or "") + content:
            assert not any("<think>" in t or "</think>" in t for _, t in pieces), parts


def test_partial_tags_are_held_back_until_the_next_delta_says():
    r1 = ReasoningStream("deepseek_r1")
    assert r1.feed("<thi") == []  # may be the opening tag
    assert r1.feed("nk>Let me see</th") == [("reasoning", "Let me see")]
    assert r1.feed("ink>") == [] and r1.feed("Paris.") == [("content", "Paris.")]
    qwen = ReasoningStream("qwen3")
    assert qwen.feed("Hi <") == [("content", "Hi ")]
    assert qwen.feed("b>") == [("content", "<b>")]  # not a tag after all
    assert qwen.feed("<think") == [] and qwen.feed(">x") == [("reasoning", "x")]
    assert qwen.feed("</") == [] and qwen.finish() == [("reasoning", "</")]  # unclosed: reasoning to the end


def test_reasoning_tokens_count_the_deltas_of_the_block():
    assert split_reasoning("deepseek_r1", ["ab", "c</think>", "de", "f"], [1, 2, 1, 1]) == ("abc", "def", 3)
    assert split_reasoning("qwen3", ["<think>", "r", "</think>", "ok"], [1, 1, 1, 1]) == ("r", "ok", 3)
    assert split_reasoning("qwen3", ["Hi", " there"], [1, 1]) == (None, "Hi there", 0)
    assert split_reasoning("deepseek_r1", ["all", " thought"], [1, 1]) == ("all thought", "", 2)
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningStream("nope")


# ---- chat_template_kwargs -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["x", [1], {"messages": []}, {"tools": None}, {"add_generation_prompt": False},
                                   {"bos_token": "<s>"}, {"eos_token": ""}, {"not-a-name": 1}, {"": 1}])
def test_bad_chat_template_kwargs_name_the_field(value):
    with pytest.raises(InvalidRequest) as e:
        check_template_kwargs(value)
    assert e.value.param == "chat_template_kwargs"


def test_default_kwargs_go_under_the_requests_own():
    settings = ServerSettings(["m"], default_chat_template_kwargs={"enable_thinking": False, "style": "terse"})
    assert settings.template_kwargs(None) == {"enable_thinking": False, "style": "terse"}
    assert settings.template_kwargs({"enable_thinking": True}) == {"enable_thinking": True, "style": "terse"}
    assert ServerSettings(["m"]).template_kwargs({}) == {}
    assert parse_template_kwargs_flag('{"enable_thinking": false}') == {"enable_thinking": False}


@pytest.mark.parametrize("flag,fragment", [
    (["--reasoning-parser", "nope"], "invalid choice: 'nope'"),
    (["--default-chat-template-kwargs", "[1]"], "must be an object"),
    (["--default-chat-template-kwargs", "{bad"], "not valid JSON"),
    (["--default-chat-template-kwargs", '{"messages": 1}'], "'messages' is set by the server"),
])
def test_bad_flags_are_usage_errors(flag, fragment):
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", *flag], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and fragment in r.stderr and flag[0] in r.stderr, r.stderr
    if flag[0] == "--reasoning-parser":
        assert "deepseek_r1" in r.stderr and "qwen3" in r.stderr


TEMPLATE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif -%}"
            "{%- if style is defined %}[style={{ style }}]{% endif -%}")


def test_kwargs_reach_the_template():
    from tests.models.tiny import smollm2_tokenizer
    from tokenmill.server.prompts import PromptEncoder
    from tokenmill.tokenizer import Tokenizer

    hf = copy.deepcopy(smollm2_tokenizer())
    hf.chat_template = TEMPLATE
    encoder = PromptEncoder(Tokenizer(hf))
    msgs = [{"role": "user", "content": "Hi"}]
    plain, _ = asyncio.run(encoder.render_chat(msgs, True))
    off, ids = asyncio.run(encoder.render_chat(msgs, True, None, {"enable_thinking": False, "style": "x"}))
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert off == plain + "<think>\n\n</think>\n\n[style=x]" and ids == Tokenizer(hf).encode(off, False)


# ---- real servers ---------------------------------------------------------------------------------------------------
R1_REGEX = r"[a-z ]{1,24}</think>[A-Za-z ]{1,24}"
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
CALL_REGEX = CALL.replace("{", r"\{").replace("}", r"\}").replace("\n", r"\n")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Think about the capital of France, then answer."}]


@pytest.fixture(scope="module")
def server():
    s = start_server("--reasoning-parser", "deepseek_r1")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A tiny random model whose chat template shows its variables, under --reasoning-parser qwen3."""
    from tests.models.tiny import make_tiny_model, smollm2_tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("reasoning"))
    hf = copy.deepcopy(smollm2_tokenizer())
    hf.chat_template = TEMPLATE
    hf.save_pretrained(path)
    s = start_server("--model", str(path), "--reasoning-parser", "qwen3",
                     "--default-chat-template-kwargs", '{"style": "terse"}')
    try:
        yield s
    finally:
        s.stop()


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def raw_completion(server, messages: list[dict], regex: str, **extra) -> str:
    """The same prompt through /v1/completions (which no parser touches), as token ids from /tokenize."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        ids = http.post("/tokenize", json={"messages": messages, **extra}).json()["tokens"]
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 64, "temperature": 0,
                                               "guided_regex": regex})
    return r.json()["choices"][0]["text"]


def reasoning_of(message) -> str | None:
    return getattr(message, "reasoning_content", None)


@pytest.mark.slow
def test_deepseek_r1_splits_a_chat_answer_plain_and_streamed(server):
    client = client_of(server)
    kwargs = dict(model=server.model, messages=MSGS, temperature=0, max_tokens=64,
                  extra_body={"guided_regex": R1_REGEX})
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    raw = raw_completion(server, MSGS, R1_REGEX)
    assert re.fullmatch(R1_REGEX, raw) and "</think>" in raw
    assert reasoning_of(msg) + "</think>" + msg.content == raw and "think>" not in msg.content
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(reasoning_of(d) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (reasoning_of(msg), msg.content)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert not any(reasoning_of(d) for d in deltas[first_content:])  # reasoning first, then content
    usage = chunks[-1].usage  # the same counts streamed (the prompt now cached aside)
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (
        r.usage.completion_tokens, details.reasoning_tokens)
    unclosed = client.chat.completions.create(**{**kwargs, "extra_body": {"guided_regex": "[a-z ]{1,12}"}})
    assert unclosed.choices[0].message.content is None and reasoning_of(unclosed.choices[0].message)


@pytest.mark.slow
def test_n_choices_each_split(server):
    client = client_of(server)
    kwargs = dict(model=server.model, messages=MSGS, n=3, temperature=1.0, seed=7, max_tokens=64,
                  extra_body={"guided_regex": R1_REGEX})
    r = client.chat.completions.create(**kwargs)
    whole = [(reasoning_of(c.message), c.message.content) for c in r.choices]
    for reasoning, content in whole:
        assert re.fullmatch(R1_REGEX, f"{reasoning}</think>{content}")
    parts = {i: ["", ""] for i in range(3)}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            parts[c.index][0] += reasoning_of(c.delta) or ""
            parts[c.index][1] += c.delta.content or ""
    assert [tuple(p) for p in parts.values()] == whole  # seeded: the same samples streamed


@pytest.mark.slow
def test_tool_calls_are_parsed_out_of_the_content_only(server):
    client = client_of(server)
    base = dict(model=server.model, messages=MSGS, tools=[WEATHER], temperature=0, max_tokens=80)
    after = CALL_REGEX
    r = client.chat.completions.create(**base, extra_body={"guided_regex": f"[a-z ]{{1,12}}</think>{after}"})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and reasoning_of(choice.message)
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    chunks = list(client.chat.completions.create(**base, stream=True,
                                                 extra_body={"guided_regex": f"[a-z ]{{1,12}}</think>{after}"}))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].function.name == "get_weather"
    assert "".join(reasoning_of(c.choices[0].delta) or "" for c in chunks if c.choices) == reasoning_of(choice.message)
    inside = client.chat.completions.create(**base, extra_body={"guided_regex": f"{after}</think>[a-z]{{1,5}}"})
    m = inside.choices[0].message  # a call written while reasoning is reasoning, not a call
    assert m.tool_calls is None and reasoning_of(m) == CALL and inside.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_bad_chat_template_kwargs_get_400(server):
    client = client_of(server)
    for value in ("x", {"messages": []}, {"add_generation_prompt": False}, {"eos_token": ""}, {"a b": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=2,
                                           extra_body={"chat_template_kwargs": value})
        assert e.value.body["param"] == "chat_template_kwargs", e.value.body
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        r = http.post("/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"tools": []}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
        ok = client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=2,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert ok.choices[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_qwen3_parser_and_kwargs_reaching_the_template(tiny_server):
    s, client = tiny_server, client_of(tiny_server)

    def rendered(**extra) -> str:
        with httpx.Client(base_url=s.url, headers=s.headers, timeout=120) as http:
            ids = http.post("/tokenize", json={"messages": MSGS, **extra}).json()["tokens"]
            return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    assert rendered().endswith("<|im_start|>assistant\n[style=terse]")  # the server's default
    assert rendered(chat_template_kwargs={"enable_thinking": False, "style": "long"}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n[style=long]")
    regex = r"<think>[a-z ]{1,16}</think>[a-z ]{1,16}"
    r = client.chat.completions.create(model=s.model, messages=MSGS, temperature=0, max_tokens=48,
                                       extra_body={"guided_regex": regex})
    msg = r.choices[0].message
    assert "<think>" + reasoning_of(msg) + "</think>" + msg.content == raw_completion(s, MSGS, regex)
    plain = client.chat.completions.create(model=s.model, messages=MSGS, temperature=0, max_tokens=48,
                                           extra_body={"guided_regex": "[a-z ]{1,16}",
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(plain.choices[0].message) is None and plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(client.chat.completions.create(model=s.model, messages=MSGS, temperature=0, max_tokens=48,
                                                 stream=True, extra_body={"guided_regex": regex}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(reasoning_of(d) or "" for d in deltas) == reasoning_of(msg)
    assert "".join(d.content or "" for d in deltas) == msg.content
