"""Text <-> token ids, chat templates and stop ids, over a transformers fast tokenizer.

For a GGUF, transformers rebuilds the tokenizer from the file's metadata but takes several seconds
(its GGUF reader is slow on a 49k-entry vocabulary). For byte-level BPE vocabularies whose pre-tokenizer
transformers leaves at GPT-2's default (SmolLM2's `smollm` among them) we build the same `tokenizers`
object directly from our own fast GGUF reader; tests check it encodes identically. Any other GGUF
tokenizer goes through transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf import GGUFFile

log = logging.getLogger(__name__)

# llama.cpp pre-tokenizer names for which transformers' GGUF conversion keeps GPT-2's byte-level regex
# (it installs a different split regex for e.g. llama3, qwen2, tekken). Only these take the fast path.
FAST_GGUF_PRE_TOKENIZERS = frozenset({"smollm", "gpt2", "default"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """The one tokenizer interface the engine and server use, whatever form the model came in."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Iterable[int] = (),
                 fim_token_ids: tuple[int, int, int] | None = None):
        self._hf = hf_tokenizer
        own = [hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else []
        self._eos_ids = list(dict.fromkeys(int(i) for i in [*own, *eos_token_ids]))
        self._backend_decode = _backend_decode(hf_tokenizer)
        self._fim = fim_token_ids if fim_token_ids is not None else _fim_by_name(hf_tokenizer)

    # -- loading ---------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | str) -> Tokenizer:
        """From a Hugging Face directory or a .gguf file (the same paths the model loader accepts)."""
        path = Path(path)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls._load_gguf(path)
        if not path.is_dir():
            raise ModelLoadError(f"cannot load a tokenizer from {path}: expected a Hugging Face model "
                                 "directory or a .gguf file")
        return cls._load_hf_dir(path)

    @classmethod
    def _load_hf_dir(cls, path: Path) -> Tokenizer:
        try:
            loader = _direct_loader(path)
            if loader is None:
                from transformers import AutoTokenizer as loader
            hf = loader.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos += _ids(_json_field(path / name, "eos_token_id"))
        return cls(hf, eos)

    @classmethod
    def _load_gguf(cls, path: Path) -> Tokenizer:
        gguf = GGUFFile.open(path)
        hf = build_fast_gguf_tokenizer(gguf.metadata)
        if hf is None:
            hf = _transformers_gguf_tokenizer(path)
        eos = [gguf.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        fim = tuple(gguf.get(f"tokenizer.ggml.fim_{k}_token_id") for k in ("pre", "suf", "mid"))
        return cls(hf, [i for i in eos if i is not None], fim if None not in fim else None)

    # -- text <-> ids ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` adds BOS/EOS only where the model's tokenizer asks for them."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text, without the "clean-up" of spaces before punctuation, so decode inverts encode."""
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                               clean_up_tokenization_spaces=False)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return self._hf.convert_ids_to_tokens(list(ids))

    # -- chat ------------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> str:
        """The prompt text the model's chat template makes of `messages` (and `tools`, for a template that takes
        them: `template_takes_tools`); `template_kwargs` are extra template variables (e.g. enable_thinking);
        `continue_final_message`: the last message left open, for the model to go on with it."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template, so chat messages cannot be turned into a "
                             "prompt; send a plain text prompt (the completions API) instead")
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            tools=tools or None, continue_final_message=continue_final_message,
                                            **(template_kwargs or {}))

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself (else tools go in the system message)."""
        return self.has_chat_template and "tools" in (self._hf.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; the template writes any BOS itself, so none is added."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    # -- facts -----------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a generation: the tokenizer's EOS plus the model's (GGUF eos/eot/eom,
        config.json and generation_config.json)."""
        return list(self._eos_ids)

    @property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle) of a code model, or None: a GGUF file's
        tokenizer.ggml.fim_{pre,suf,mid}_token_id, else the usual names in the vocabulary (Qwen2.5-Coder's
        <|fim_prefix|> ..., StarCoder's <fim_prefix> ...)."""
        return self._fim

    def infill(self, prefix: str, suffix: str) -> list[int]:
        """The prompt of a fill-in-the-middle completion (prefix-suffix-middle order, as llama.cpp's /infill and
        vLLM build it): [BOS] <prefix> prefix <suffix> suffix <middle>; the model writes the middle."""
        if self._fim is None:
            raise ValueError("this model has no fill-in-the-middle tokens")
        pre, suf, mid = self._fim
        bos = [self.bos_token_id] if self.bos_token_id is not None and self.encode("x")[:1] == [
            self.bos_token_id] else []
        return [*bos, pre, *self.encode(prefix, False), suf, *self.encode(suffix, False), mid]

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self._hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._hf.all_special_ids)

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer, for callers that need more (e.g. save_pretrained)."""
        return self._hf


# -------------------------------------------------------------------------------------------------------
# Helpers
# -------------------------------------------------------------------------------------------------------


FIM_NAMES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def _fim_by_name(hf_tokenizer: Any) -> tuple[int, int, int] | None:
    """The first set of FIM_NAMES that are all single tokens of this vocabulary."""
    vocab = hf_tokenizer.get_vocab()
    for names in FIM_NAMES:
        if all(n in vocab for n in names):
            return tuple(int(vocab[n]) for n in names)
    return None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _direct_loader(path: Path) -> Any | None:
    """TokenizersBackend where the directory's tokenizer is a plain `tokenizer.json` that AutoTokenizer would load
    as one anyway, else None (AutoTokenizer decides). AutoTokenizer first reads the model's config through
    AutoConfig, whose imports (the model family's modules) took 1.7 s of a tiny model's 5 s server start."""
    declared = _json_field(path / "tokenizer_config.json", "tokenizer_class")
    if (not (path / "tokenizer.json").is_file() or declared not in ("TokenizersBackend", "PreTrainedTokenizerFast")
            or _json_field(path / "tokenizer_config.json", "auto_map") is not None):
        return None
    try:
        from transformers import TokenizersBackend
    except ImportError:  # transformers 4 has no such class
        return None
    return TokenizersBackend


def _json_field(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _transformers_gguf_tokenizer(path: Path) -> Any:
    """The slow, general path: transformers' own GGUF tokenizer conversion, kept on disk once made
    (converted_tokenizer_dir): gguf-py reads a 262k-token vocabulary field by field, ~17 s for Gemma 3 on a 2-core
    Zen 4 at every start, where the saved tokenizer.json loads in about a second."""
    from transformers import AutoTokenizer

    cached = converted_tokenizer_dir(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError) as e:
            log.warning("the saved tokenizer in %s does not load (%s); converting %s again", cached, e, path)
    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e
    if cached is not None:
        _save_converted(hf, cached)
    return hf


def converted_tokenizer_dir(path: Path) -> Path | None:
    """Where the tokenizer converted from GGUF file `path` is kept: $TOKENMILL_CACHE (default ~/.cache/tokenmill)
    /tokenizers/, keyed by the file's name, size and modification time (a rewritten file converts again); None
    without a home to keep it in."""
    try:
        stat = path.stat()
        root = Path(os.environ.get("TOKENMILL_CACHE") or Path.home() / ".cache" / "tokenmill")
    except (OSError, RuntimeError):
        return None
    return root / "tokenizers" / f"{path.name}-{stat.st_size}-{stat.st_mtime_ns}"


def _save_converted(hf: Any, target: Path) -> None:
    """Save next to the target, then rename: a reader never sees half a tokenizer, and a failure leaves none."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        hf.save_pretrained(str(tmp))
        tmp.rename(target)
    except OSError as e:  # read-only or full: the next start converts again
        log.info("the converted tokenizer was not kept (%s)", e)
        shutil.rmtree(tmp, ignore_errors=True)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are given
    the code points 256, 257, ... in byte order, which is why a space shows up as 'Ġ' (U+0120).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_fast_gguf_tokenizer(metadata: dict[str, Any]) -> Any | None:
    """A transformers fast tokenizer for a byte-level BPE GGUF vocabulary, or None if not applicable.

    Mirrors what transformers' GGUF conversion produces for these files: BPE over the vocabulary
    (tokens outside the byte alphabet re-spelled through it), the file's merges, GPT-2's byte-level
    pre-tokenizer and decoder, control tokens as special added tokens, user-defined ones as plain
    added tokens, and the special-token names and add_bos/add_eos flags from the metadata.
    """
    if metadata.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in metadata:
        return None
    if metadata.get("tokenizer.ggml.pre", "default") not in FAST_GGUF_PRE_TOKENIZERS:
        return None
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    alphabet = set(byte_to_unicode().values())
    spell = byte_to_unicode()
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        return None
    raw = RawTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                           end_of_word_suffix="", fuse_unk=False))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()

    def name_of(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=name_of("bos_token_id"),
        eos_token=name_of("eos_token_id"),
        unk_token=name_of("unknown_token_id"),
        pad_token=name_of("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
    types = metadata.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, normalized=False, special=True)
               for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    if control:
        hf.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    known = hf.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == _USER_DEFINED and t in known]
    if user:
        hf.add_tokens(user)
    return hf


def _backend_decode(hf_tokenizer: Any) -> Any:
    """The `tokenizers` object's own decode where transformers' decode comes down to it: a fast tokenizer whose
    decode and _decode are transformers' own (no subclass changes them) returns the backend's text as is when the
    clean-up is off. Streaming decodes twice a token per request (engine/detokenizer.py); transformers' wrappers
    around it took 3.5 of a call's 4.7 us (SmolLM2, a 9-token window, warm caches). None: go through transformers."""
    from transformers import PreTrainedTokenizerFast

    kind = type(hf_tokenizer)
    if (isinstance(hf_tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerFast.decode
            and kind._decode is PreTrainedTokenizerFast._decode):
        return hf_tokenizer.backend_tokenizer.decode
    return None
