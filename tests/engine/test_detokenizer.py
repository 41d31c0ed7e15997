"""IncrementalDetokenizer against SmolLM2's real tokenizer: streamed text equals a one-shot decode, multi-byte
characters split across tokens, stop strings (cut, include, num_used, held-back tail) and special tokens."""

from __future__ import annotations

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.model.paths import default_model_path
from tokenmill.tokenizer import Tokenizer

ANSWER = "The answer is 42.\n\nQuestion: what"
CHAT = "<|im_start|>assistant\nhi<|im_end|>"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(default_model_path())


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Appends the ids one at a time; returns `text` after each."""
    texts = []
    for t in ids:
        detok.append([t])
        texts.append(detok.text)
    return texts


@pytest.mark.parametrize("text", [
    ANSWER,
    "emoji 🎉🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "日本語のテキスト 中文 한국어",
    "Café naïve résumé Straße Ωμέγα",
    "def f(x):\n    return x ** 2  # comment\n",
    "  leading spaces and trailing   ",
])
def test_text_built_token_by_token_equals_a_one_shot_decode(tok, text):
    """Streaming never shows a replacement character for a character still being completed, only ever appends,
    and ends with exactly what decoding all the output ids at once gives."""
    prompt = ids_of(tok, "Please repeat after me:")
    out = ids_of(tok, " " + text)
    detok = IncrementalDetokenizer(tok, prompt, [])
    texts = feed(detok, out)
    assert detok.text == tok.decode(out) == " " + text
    for before, after in zip(["", *texts], texts):
        assert after.startswith(before)
        assert "\ufffd" not in after


def test_a_multibyte_character_split_across_tokens_comes_out_whole_in_one_delta(tok):
    """An emoji whose UTF-8 bytes span three tokens adds nothing until its last byte arrives, then all at once."""
    out = ids_of(tok, "go 🎉!")
    pieces = [tok.decode([t]) for t in out]
    assert sum("\ufffd" in p for p in pieces) >= 2, pieces
    detok = IncrementalDetokenizer(tok, ids_of(tok, "Say:"), [])
    texts = feed(detok, out)
    deltas = [after[len(before):] for before, after in zip(["", *texts], texts)]
    assert " 🎉" in deltas
    assert "".join(deltas) == "go 🎉!"
    assert all("\ufffd" not in d for d in deltas)


def test_the_prompt_context_does_not_leak_into_the_text(tok):
    """The prompt's last tokens only give the first output token its context: none of the prompt is output, and
    a stop string inside the prompt does not stop the output."""
    detok = IncrementalDetokenizer(tok, ids_of(tok, "The answer is"), ["answer"])
    assert detok.append(ids_of(tok, " 42.")) is None
    assert detok.text == " 42."
    assert detok.stopped_by is None


@pytest.mark.parametrize("include, expected", [
    (False, "The answer is 42."),
    (True, "The answer is 42.\n\nQuestion"),
])
def test_a_stop_string_spanning_several_tokens_ends_the_text_at_it(tok, include, expected):
    """A stop string made of three tokens is found only when its last token arrives; the text ends right before
    it, or right after it with include_stop_str_in_output."""
    out = ids_of(tok, ANSWER)
    stop = "\n\nQuestion"
    last = next(i for i in range(len(out)) if stop in tok.decode(out[:i + 1]))
    assert stop not in tok.decode(out[last:last + 1])
    detok = IncrementalDetokenizer(tok, [], [stop], include_stop=include)
    for i, t in enumerate(out[:last + 1]):
        assert detok.append([t]) == (stop if i == last else None)
    assert detok.text == expected
    assert detok.stopped_by == stop


def test_num_used_counts_the_tokens_up_to_the_one_completing_the_stop(tok):
    """With several tokens in one append (speculation), `num_used` is how many it took to complete the stop
    string; the tokens after it change nothing, and a later append uses none."""
    out = ids_of(tok, ANSWER)
    stop = "\n\nQuestion"
    needed = next(i + 1 for i in range(len(out)) if stop in tok.decode(out[:i + 1]))
    assert needed < len(out)
    detok = IncrementalDetokenizer(tok, [], [stop])
    assert detok.append(out[:3]) is None
    assert detok.num_used == 3
    assert detok.append(out[3:]) == stop
    assert detok.num_used == needed - 3
    assert detok.text == "The answer is 42."
    assert detok.append(ids_of(tok, " more")) == stop
    assert detok.num_used == 0
    assert detok.text == "The answer is 42."


def test_the_stop_string_completed_first_wins(tok):
    """Of several stop strings, the one completed by the earliest token ends the output, whatever the list order."""
    out = ids_of(tok, ANSWER)
    detok = IncrementalDetokenizer(tok, [], ["Question", "42"])
    assert detok.append(out) == "42"
    assert detok.text == "The answer is "
    assert detok.num_used == len(ids_of(tok, "The answer is 42"))


def test_a_stop_string_inside_one_token_cuts_the_text_within_that_token(tok):
    """A stop string that is only part of a token's text cuts the text mid-token, and that token counts as used."""
    out = ids_of(tok, ANSWER)
    assert tok.decode(out[1:2]) == " answer"
    detok = IncrementalDetokenizer(tok, [], ["nsw"])
    assert detok.append(out) == "nsw"
    assert (detok.text, detok.num_used) == ("The a", 2)


def test_visible_text_holds_back_a_possible_stop_prefix_until_resolved(tok):
    """While a stop string could still be completing, its possible start is not visible; visible text only
    grows, and once the stop string is found it shows the cut text."""
    stop = "\n\nQuestion"
    out = ids_of(tok, ANSWER)
    detok = IncrementalDetokenizer(tok, [], [stop])
    visible = []
    for t in out:
        done = detok.append([t])
        visible.append(detok.visible_text(finished=False))
        if done:
            break
    for before, after in zip(["", *visible], visible):
        assert after.startswith(before)
    assert detok.stopped_by == stop
    assert all("\n" not in v for v in visible)
    assert visible[-2] != visible[-1] == "The answer is 42."


def test_visible_text_releases_the_held_tail_when_it_is_not_a_stop(tok):
    """A tail that looked like a stop string's start is shown once the request finishes without it."""
    out = ids_of(tok, "The answer is 42.\n\nAnswer")
    detok = IncrementalDetokenizer(tok, [], ["\n\nQuestion"])
    assert detok.append(out) is None
    assert len(detok.visible_text(finished=False)) == len(detok.text) - len("\n\nQuestion") + 1
    assert detok.visible_text(finished=True) == detok.text == "The answer is 42.\n\nAnswer"


def test_visible_text_holds_nothing_back_without_multi_character_stops(tok):
    """With no stop strings, or only one-character ones, nothing can be a pending prefix: all text is visible."""
    out = ids_of(tok, ANSWER)
    for stop in ([], ["?"]):
        detok = IncrementalDetokenizer(tok, [], stop)
        for t in out:
            detok.append([t])
            assert detok.visible_text(finished=False) == detok.text
        assert detok.text == ANSWER


@pytest.mark.parametrize("skip, expected", [
    (True, "assistant\nhi"),
    (False, CHAT),
])
def test_skip_special_tokens_on_and_off(tok, skip, expected):
    """Special tokens are left out of the text with skip_special_tokens, and kept verbatim without it."""
    out = ids_of(tok, CHAT)
    assert len(out) == 6
    detok = IncrementalDetokenizer(tok, [], [], skip_special_tokens=skip)
    texts = feed(detok, out)
    assert detok.text == expected == tok.decode(out, skip_special_tokens=skip)
    assert texts[0] == ("" if skip else "<|im_start|>")


@pytest.mark.parametrize("skip, stopped", [(True, False), (False, True)])
def test_a_special_token_matches_a_stop_string_only_when_not_skipped(tok, skip, stopped):
    """A stop string spelling a special token is seen only when special tokens are part of the text."""
    out = ids_of(tok, CHAT)
    detok = IncrementalDetokenizer(tok, [], ["<|im_end|>"], skip_special_tokens=skip)
    result = detok.append(out)
    assert (result == "<|im_end|>") is stopped
    assert detok.text == ("<|im_start|>assistant\nhi" if stopped else "assistant\nhi")
    assert detok.num_used == len(out)
