"""Tokenizer: SmolLM2's GGUF tokenizer (our fast build vs transformers'), chat template, stop ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf import GGUFFile
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer, _direct_loader, build_fast_gguf_tokenizer

TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "numbers 12345 3.14159 1,000,000 -42 0x1F",
    "don't won't they're I'll we've she'd",
    "Café naïve résumé Straße Ωμέγα",
    "日本語のテキスト 中文 한국어",
    "emoji 🎉🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name> tokens",
    "<|im_start|partial <|im_end",
    "",
    " ",
    "a" * 300,
    "Mixed CASE, punctuation!?!... «quotes» — dashes – and ‘curly’ “quotes”",
    "\u0000 control \u0007 chars \u00ad soft hyphen",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.load(default_model_path())


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF tokenizer: what the fast build must equal."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_smollm2_uses_the_fast_build(smol: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    assert isinstance(smol.hf_tokenizer, PreTrainedTokenizerFast)
    metadata = GGUFFile.open(default_model_path()).metadata
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    assert build_fast_gguf_tokenizer(metadata) is not None


def test_fast_build_backend_equals_transformers(smol: Tokenizer, reference) -> None:
    ours = json.loads(smol.hf_tokenizer.backend_tokenizer.to_str())
    theirs = json.loads(reference.backend_tokenizer.to_str())
    assert ours == theirs  # same vocab, merges, added tokens, pre-tokenizer, decoder, post-processor


@pytest.mark.parametrize("text", TEXTS)
def test_fast_build_tokenizes_like_transformers(smol: Tokenizer, reference, text: str) -> None:
    for special in (True, False):
        ids = smol.encode(text, add_special_tokens=special)
        assert ids == reference.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert smol.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_decode_goes_straight_to_the_backend_only_where_transformers_would(smol: Tokenizer) -> None:
    import copy

    ids = smol.encode("<|im_start|>assistant\nHi, there!<|im_end|>")
    assert smol._backend_decode is not None  # SmolLM2's fast tokenizer: the `tokenizers` call itself
    assert smol.decode(ids) == smol.hf_tokenizer.decode(ids, skip_special_tokens=True,
                                                        clean_up_tokenization_spaces=False)

    class OwnDecode(type(smol.hf_tokenizer)):  # a tokenizer class with its own _decode keeps it
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "own"

    hf = copy.copy(smol.hf_tokenizer)
    hf.__class__ = OwnDecode
    assert Tokenizer(hf).decode(ids) == "own"


def test_special_tokens_like_transformers(smol: Tokenizer, reference) -> None:
    ours = smol.hf_tokenizer
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert smol.bos_token_id == reference.bos_token_id == 1
    assert smol.vocab_size == len(reference) == 49152
    assert smol.convert_ids_to_tokens([0, 1, 2, 3]) == reference.convert_ids_to_tokens([0, 1, 2, 3])
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert smol.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)


def test_only_verified_pre_tokenizers_take_the_fast_path() -> None:
    metadata = dict(GGUFFile.open(default_model_path()).metadata)
    assert build_fast_gguf_tokenizer({**metadata, "tokenizer.ggml.pre": "llama-bpe"}) is None
    assert build_fast_gguf_tokenizer({**metadata, "tokenizer.ggml.model": "llama"}) is None


@pytest.mark.parametrize("text", [t for t in TEXTS if "<|" not in t and "<repo" not in t])
def test_round_trip(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text)) == text


def test_no_bos_added_for_smollm2(smol: Tokenizer) -> None:
    """The GGUF says add_bos_token = False; SmolLM2's chat template writes <|im_start|> itself."""
    ids = smol.encode("Hello")
    assert ids and ids[0] != smol.bos_token_id
    assert smol.encode("Hello", add_special_tokens=False) == ids


def test_decode_skips_special_tokens(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smol.decode(ids) == "assistant\nHi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


def test_chat_template_renders_im_start_format(smol: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = smol.render_chat(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not smol.render_chat(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = smol.apply_chat_template(messages)
    assert ids == smol.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... two <|im_end|>
    default_system = smol.render_chat([{"role": "user", "content": "hi"}])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_eos_ids_include_im_end(smol: Tokenizer) -> None:
    assert 2 in smol.eos_token_ids
    assert smol.convert_ids_to_tokens([2]) == ["<|im_end|>"]


def test_tiny_model_dir_tokenizer(tmp_path: Path, smol: Tokenizer) -> None:
    model_dir = make_tiny_model(tmp_path)
    tok = Tokenizer.load(model_dir)
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    for text in TEXTS[:8]:
        assert tok.encode(text) == smol.encode(text)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages) == smol.apply_chat_template(messages)


def test_a_plain_tokenizer_json_loads_as_autotokenizer_would(tmp_path: Path) -> None:
    """A directory whose tokenizer_config names TokenizersBackend skips AutoTokenizer's config import; the result
    must be the tokenizer AutoTokenizer gives. Another declared class still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    model_dir = make_tiny_model(tmp_path)
    ours, auto = Tokenizer.load(model_dir)._hf, AutoTokenizer.from_pretrained(str(model_dir))
    assert type(ours) is type(auto)
    assert ours.all_special_tokens == auto.all_special_tokens and ours.get_vocab() == auto.get_vocab()
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (auto.bos_token, auto.eos_token, auto.pad_token)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": "GPT2TokenizerFast"}))
    assert _direct_loader(model_dir) is None
    assert Tokenizer.load(model_dir).encode(TEXTS[0]) == auto.encode(TEXTS[0])


def test_generation_config_eos_ids_join(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.load(model_dir).eos_token_ids == [2, 0]


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    tok = Tokenizer.load(model_dir)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.encode("still works") == Tokenizer.load(default_model_path()).encode("still works")


def test_bad_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        Tokenizer.load(tmp_path / "missing")
    garbage = tmp_path / "x.gguf"
    garbage.write_bytes(b"not a gguf at all, just some bytes")
    with pytest.raises(ModelLoadError, match=r"x\.gguf.*not a GGUF file"):
        Tokenizer.load(garbage)


def test_a_tokenizer_converted_from_gguf_is_kept_and_read_back(tmp_path, monkeypatch):
    """transformers' GGUF conversion (the slow path: ~17 s for Gemma 3's vocabulary) runs once per file: the result
    is saved under $TOKENMILL_CACHE keyed by the file's name, size and mtime, and a later load reads it back, the
    same tokenizer."""
    import shutil as sh

    from tokenmill.model.paths import default_model_path
    from tokenmill.tokenizer import _transformers_gguf_tokenizer, converted_tokenizer_dir

    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    sh.copy(default_model_path(), gguf)
    first = _transformers_gguf_tokenizer(gguf)
    kept = converted_tokenizer_dir(gguf)
    assert kept.parent == tmp_path / "cache" / "tokenizers" and (kept / "tokenizer.json").is_file()
    import transformers

    calls = []
    load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: calls.append(kw.get("gguf_file")) or load(*a, **kw))
    again = _transformers_gguf_tokenizer(gguf)
    assert calls == [None] and not list(kept.parent.glob("*.tmp-*"))  # read back, not converted again
    text = "Hello, world! ünïcödé 日本語 <|im_start|>user\n  two  spaces"
    assert again.encode(text) == first.encode(text) and again.all_special_ids == first.all_special_ids
    later = gguf.stat().st_mtime_ns + 10**9  # a rewritten file gets a new key
    os.utime(gguf, ns=(later, later))
    assert converted_tokenizer_dir(gguf) != kept
