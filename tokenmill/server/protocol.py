"""Request bodies of the OpenAI-compatible API (pydantic), and their translation to SamplingParams.

Pydantic checks types and shapes; value ranges are SamplingParams' job (one set of rules for the offline and the
HTTP API), plus a few limits that keep the sampler's arithmetic finite. Any failure is an InvalidRequest (here) or
a BadRequest (json_body.py: reading and validating a body) naming the field: always HTTP 400, never FastAPI's 422.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.engine.admission import check_token_ids, validate_cache_salt
from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams
from tokenmill.server.tools import ToolChoice
from tokenmill.structured_params import StructuredOutputsParams

# Below this a temperature is greedy (as vLLM does): dividing float32 logits by less overflows to inf.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01  # logits are divided by it; much less overflows float32 after temperature
MAX_STOP_STRINGS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); NaN and infinities are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    cache_salt: str | None = None  # tenants with different salts never share cached KV blocks
    prompt_logprobs: int | None = None  # vLLM's extra: a `prompt_logprobs` list in each choice
    speculate: bool = True  # tokenmill's extra: false opts the request out of speculative decoding
    priority: int = 0  # vLLM's extra: lower runs first under --scheduling-policy priority
    slo_ttft_ms: float | None = None  # tokenmill's extras: this request's latency targets (else the server's)
    slo_itl_ms: float | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's disaggregated prefill/decode field: ship this prompt's KV, or take it (tokenmill/disagg/transfer.py)
    kv_transfer_params: dict[str, Any] | None = None

    def check_prompt_logprobs(self) -> None:
        """Checked here, not only in SamplingParams: completions may compute more for echo, hiding a bad value."""
        if self.prompt_logprobs is None:
            return
        if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="prompt_logprobs")
        if self.stream:  # vLLM sends them in the first chunk; here they come only in a whole response
            raise InvalidRequest("prompt_logprobs is not supported with stream: true (on /v1/completions, echo: true "
                                 "with logprobs streams the prompt tokens' logprobs)", param="prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of is not supported (only best_of == n)", param="best_of")
        validate_cache_salt(self.cache_salt)
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature > MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}]", param="temperature")
        if 0 < temperature < MIN_TEMPERATURE:
            temperature = 0.0
        rep = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        if rep < MIN_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} (1 = off)",
                                 param="repetition_penalty")
        top_k = 0 if self.top_k is None else self.top_k
        if top_k >= vocab_size:
            top_k = 0  # as good as off, and keeps huge values away from torch
        stream_options = self.stream_options
        if stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed with stream: true", param="stream_options")
        return SamplingParams(
            n=self.n, temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
            min_p=self.min_p or 0.0, repetition_penalty=rep, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=stops or None, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            speculate=self.speculate, priority=self.priority, slo_ttft_ms=self.slo_ttft_ms,
            slo_itl_ms=self.slo_itl_ms, structured_outputs=self.structured(),
            logit_bias=token_biases(self.logit_bias, vocab_size))

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for (400 naming the fields when it asks for two)."""
        given = {name: value for name, value in (
            ("response_format", _response_format(self.response_format)),
            ("structured_outputs", self.structured_outputs),
            ("guided_json", {"json": self.guided_json} if self.guided_json is not None else None),
            ("guided_regex", {"regex": self.guided_regex} if self.guided_regex is not None else None),
            ("guided_choice", {"choice": self.guided_choice} if self.guided_choice is not None else None),
            ("guided_grammar", {"grammar": self.guided_grammar} if self.guided_grammar is not None else None),
        ) if value is not None}
        if len(given) > 1:
            first, second = list(given)[:2]
            raise InvalidRequest(f"{second}: only one output constraint per request ({first} is given too)",
                                 param=second)
        if not given:
            return None
        (name, fields), = given.items()
        param = "response_format.json_schema.schema" if name == "response_format" and "json" in fields else name
        return StructuredOutputsParams.from_dict(fields, param)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def token_biases(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, JSON keys being strings) as {token id: bias}; 400 for a key that is
    not a token id of this model (SamplingParams checks the biases' range)."""
    if not logit_bias:
        return None
    biases = {}
    for key, bias in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys are token ids; {key!r} is not one", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias: token id {token} is out of range [0, {vocab_size})", param="logit_bias")
        biases[token] = bias
    return biases


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_params(self, vocab_size: int) -> SamplingParams:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs")
        self.check_prompt_logprobs()
        return self.sampling_params(self.max_tokens, self.logprobs, vocab_size, self.scored_prompt_logprobs)

    @property
    def scored_prompt_logprobs(self) -> int | None:
        """The top-N the engine computes for prompt tokens: enough for both `prompt_logprobs` and echo."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")


def prompt_list(value: str | list[str] | list[int] | list[list[int]], param: str) -> list[str | list[int]]:
    """A prompt field (a string, strings, token ids, or lists of them) as a list of prompts, each a string or a list
    of token ids; an empty list is a 400 naming `param`."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


def text_of(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts ({"type": one of `kinds`, "text": a string}) joined by newlines; anything
    else is a 400 naming `where` (chat content, Anthropic's text blocks, the Responses API's input_text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.{j}: content part {kind!r} is not supported (only {', '.join(kinds)}, "
                                 "with a string text)", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (OpenAI's shape)

    def to_template(self, index: int) -> dict[str, Any]:
        """{"role", "content": str} for the chat template; list content keeps its text parts, joined by newlines."""
        param = f"messages.{index}"
        if self.role not in CHAT_ROLES:
            raise InvalidRequest(f"{param}.role: unknown role {self.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                                 param=f"{param}.role")
        content = self.content
        if self.tool_calls is not None and self.role != "assistant":
            raise InvalidRequest(f"{param}.tool_calls: only assistant messages carry tool calls",
                                 param=f"{param}.tool_calls")
        if content is None:
            if self.role != "assistant":
                raise InvalidRequest(f"{param}.content is required for role {self.role!r}", param=f"{param}.content")
            content = ""
        out: dict[str, Any] = {"role": self.role, "content": text_of(content, f"{param}.content")}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_checked_call(c, f"{param}.tool_calls.{j}") for j, c in enumerate(self.tool_calls)]
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message left open, the answer goes on with it
    echo: bool = False  # vLLM's: the answer starts with the last message's content when that is the assistant's
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra chat template variables (enable_thinking)

    def tool_choice_spec(self) -> ToolChoice | None:
        return ToolChoice.parse(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_params(self, vocab_size: int) -> SamplingParams:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequest(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="top_logprobs")
            if self.top_logprobs and not self.logprobs:
                raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        self.check_prompt_logprobs()
        params = self.sampling_params(max_tokens, logprobs, vocab_size, self.prompt_logprobs)
        tools = self.tool_choice_spec()
        calls = tools.constraint() if tools is not None else None
        if calls is not None:  # tool_choice required or a named function: the output is calls
            if params.structured_outputs is not None:
                raise InvalidRequest(f"tool_choice {self.tool_choice!r} constrains the output to tool calls; it "
                                     f"cannot be combined with {params.structured_outputs.param}",
                                     param="tool_choice")
            params = replace(params, structured_outputs=calls)
        return params

    def template_messages(self) -> list[dict[str, Any]]:
        if not self.messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message needs add_generation_prompt: false (the last message is "
                                 "continued, no new one is opened)", param="continue_final_message")
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    def echoed(self) -> str | None:
        """With echo: the text the answer starts with, the last message's content if it is the assistant's."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return None
        return self.messages[-1].to_template(len(self.messages) - 1)["content"]


class EmbeddingRequest(_Body):
    """OpenAI's /v1/embeddings body (and vLLM's extras: truncate_prompt_tokens, normalize)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as in a chat request


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


def _checked_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call in OpenAI's shape: {"id", "type": "function", "function": {"name",
    "arguments": JSON text}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
        raise InvalidRequest(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments': "
                             "JSON text}}}}", param=where)
    return {"id": call.get("id") or "", "type": "function",
            "function": {"name": fn["name"], "arguments": fn.get("arguments") or "{}"}}


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as structured_outputs fields (None for plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest("response_format.json_schema must be an object with a 'schema' (and a 'name')",
                                 param="response_format.json_schema")
        return {"json": spec["schema"]}
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         param="response_format.type")
