"""The one admission check (engine/admission.py): what it resolves, what it refuses, and the limit it names."""

import pytest

from tokenmill.engine.admission import ContextLimits, admit, validate_cache_salt
from tokenmill.errors import ContextTooLong, InvalidRequest

LIMITS = ContextLimits(max_model_len=1000, vocab_size=100, token_capacity=600)


def test_max_tokens_given_is_kept_and_none_takes_what_is_left():
    assert admit([1] * 10, 5, LIMITS) == 5
    assert admit([1] * 10, None, LIMITS) == 590  # the KV pool (600) is the tighter limit
    assert admit([1] * 10, None, ContextLimits(100, 100, 600)) == 90  # here the context window is


def test_exactly_at_each_limit_is_admitted():
    assert admit([1] * 400, 600, ContextLimits(1000, 100, 10_000)) == 600
    assert admit([1] * 400, 200, LIMITS) == 200


def test_prompt_plus_max_tokens_over_the_context_window_names_it():
    with pytest.raises(ContextTooLong, match=r"= 1001 exceeds the context window of 1000 tokens") as e:
        admit([1] * 400, 601, ContextLimits(1000, 100, 10_000))
    assert e.value.param == "max_tokens"


def test_prompt_plus_max_tokens_over_the_kv_pool_names_the_flag():
    with pytest.raises(ContextTooLong, match=r"KV cache capacity of 600 tokens; raise --kv-cache-memory") as e:
        admit([1] * 10, 591, LIMITS)
    assert e.value.param == "max_tokens"


def test_a_prompt_that_fills_the_context_window_is_refused_as_the_prompt():
    with pytest.raises(ContextTooLong, match="the prompt has 1000 tokens; the context window is 1000") as e:
        admit([1] * 1000, 1, LIMITS)
    assert e.value.param == "prompt"


def test_a_prompt_that_fills_the_kv_pool_is_refused_without_max_tokens_too():
    """With max_tokens None nothing is left to generate: refused, naming the pool, not admitted with max_tokens <= 0."""
    with pytest.raises(ContextTooLong, match="KV cache capacity of 600") as e:
        admit([1] * 700, None, LIMITS)
    assert e.value.param == "prompt"


@pytest.mark.parametrize("prompt,fragment", [([], "empty"), ([1, 100], "token id 100"), ([-1], "token id -1"),
                                             ([1, "x"], "token id x")])
def test_prompts_outside_the_vocabulary_are_invalid(prompt, fragment):
    with pytest.raises(InvalidRequest, match=fragment) as e:
        admit(prompt, 4, LIMITS)
    assert not isinstance(e.value, ContextTooLong) and e.value.param == "prompt"


def test_cache_salt_is_a_non_empty_string_or_absent():
    assert validate_cache_salt(None) is None and validate_cache_salt("tenant-a") == "tenant-a"
    for bad in ("", 3):
        with pytest.raises(InvalidRequest, match="cache_salt"):
            validate_cache_salt(bad)
