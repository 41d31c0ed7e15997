"""ServerSettings: what the HTTP layer needs to know beyond the engine (names, keys, body limit, what clients may
ask for, how chat answers are post-processed); and the checks of server flags and request fields about them."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidRequest


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None  # the clients' key (--api-key)
    admin_api_key: str | None = None  # /admin/* (--admin-api-key); without it they are off
    metrics_api_key: str | None = None  # /metrics (--metrics-api-key); without it open
    client_priority_range: tuple[int, int | None] = (0, None)  # --client-priority-range LO:HI (HI None: no bound)
    max_request_bytes: int = 16 << 20  # as --max-request-bytes' default
    max_stored_responses: int = 1000  # the Responses API's store (--max-stored-responses)
    pooling: str = "last"  # /v1/embeddings: the hidden states' pooling (--pooling)
    runner: str = "generate"  # --runner pooling: an embedding server (the generating routes answer 400)
    ui: bool = True  # the playground and dashboard at / (--no-ui: off)
    reasoning_parser: str | None = None  # --reasoning-parser: <think> blocks go to reasoning_content (reasoning.py)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under a request's own
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # --lora-modules: (name, PEFT directory)
    created: int = field(default_factory=lambda: int(time.time()))

    def check_priority(self, priority: int) -> None:
        """A client's `priority` within --client-priority-range, or a 400 naming the flag: under --scheduling-policy
        priority a lower value preempts, so by default a client may lower its standing but never raise it."""
        lo, hi = self.client_priority_range
        if priority < lo or (hi is not None and priority > hi):
            raise InvalidRequest(f"priority {priority} is outside what this server lets clients ask for "
                                 f"(--client-priority-range {format_priority_range(self.client_priority_range)})",
                                 param="priority")

    def template_kwargs(self, requested: dict[str, Any] | None) -> dict[str, Any]:
        """The chat template's extra variables: --default-chat-template-kwargs under the request's own
        chat_template_kwargs (checked: 400 naming the field)."""
        if requested is None:
            return dict(self.default_chat_template_kwargs)
        return {**self.default_chat_template_kwargs, **check_template_kwargs(requested)}

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def parse_priority_range(text: str) -> tuple[int, int | None]:
    """'LO:HI' with HI optional ('0:' = zero or more): the priorities a client may choose."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi) if hi.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or (bounds[1] is not None and bounds[1] < bounds[0]):
        raise argparse.ArgumentTypeError(f"--client-priority-range {text!r}: expected LO:HI with LO <= HI, HI optional "
                          "(e.g. 0: or -10:10)")
    return bounds


def format_priority_range(bounds: tuple[int, int | None]) -> str:
    return f"{bounds[0]}:{'' if bounds[1] is None else bounds[1]}"


# Names a template gets from the renderer itself, or apply_chat_template's own arguments: a client may not set them
# through chat_template_kwargs (the request has proper fields for the messages, tools and generation prompt).
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
})


def check_template_kwargs(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """A chat_template_kwargs value: an object whose keys are not the template's own variables (else a 400 naming
    the field)."""
    if not isinstance(kwargs, dict):
        raise InvalidRequest(f"{where} must be an object of template variables, e.g. {{\"enable_thinking\": false}}",
                             param=where)
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequest(f"{where}: {key!r} is not a template variable name", param=where)
        if key in RESERVED_TEMPLATE_NAMES:
            raise InvalidRequest(f"{where}: {key!r} is set by the server, not through {where} (use the request's "
                                 "own fields)", param=where)
    return dict(kwargs)


def parse_template_kwargs_flag(text: str) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object, checked as a request's chat_template_kwargs are."""
    flag = "--default-chat-template-kwargs"
    try:
        return check_template_kwargs(json.loads(text), flag)
    except json.JSONDecodeError as e:
        example = '{"enable_thinking": false}'
        raise argparse.ArgumentTypeError(f"{flag} is not valid JSON ({e.msg}); e.g. '{example}'") from None
    except InvalidRequest as e:
        raise argparse.ArgumentTypeError(str(e)) from None
