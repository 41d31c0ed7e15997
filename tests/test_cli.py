"""The `tokenmill` command line, run as a subprocess: help, generate, chat over stdin, flag errors; and
`parse_bytes`."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill.cli import parse_bytes

TIMEOUT = 120


def tokenmill(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], input=input, capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, check=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("cli"), arch="llama", num_heads=4, num_kv_heads=2))


def assert_one_line_error(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error: ...` line on stderr, naming each of `names`."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


# ---- help --------------------------------------------------------------------------------------------------


def test_top_level_help_lists_the_commands():
    proc = tokenmill("--help")
    assert proc.returncode == 0, proc.stderr
    for cmd in ("generate", "chat", "plan"):
        assert cmd in proc.stdout


def test_generate_help_lists_the_flags():
    proc = tokenmill("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--model", "--dtype", "--kv-cache-memory", "--block-size", "--max-num-seqs",
                 "--max-num-batched-tokens", "--max-model-len", "--max-tokens", "--temperature", "--top-p",
                 "--top-k", "--min-p", "--stop", "--sampling-seed", "--ignore-eos"):
        assert flag in proc.stdout, flag


# ---- generate / chat on the real model ---------------------------------------------------------------------


@pytest.mark.slow
def test_generate_prints_paris_and_the_kv_cache_line():
    from tokenmill.engine.runner import kv_bytes_per_token
    from tokenmill.model.loader import default_model_path, load_model_config

    proc = tokenmill("generate", "The capital of France is", "--max-tokens", "12", "--temperature", "0",
                     "--kv-cache-memory", "64MiB", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr
    m = re.search(r"KV cache: (\d+) blocks x (\d+) tokens = (\d+) tokens, (\d+) bytes per token \(float32\)",
                  proc.stderr)
    assert m, proc.stderr
    blocks, block_size, tokens, per_token = map(int, m.groups())
    import torch

    assert per_token == kv_bytes_per_token(load_model_config(default_model_path()), torch.float32)
    assert block_size == 16 and tokens == blocks * block_size
    assert blocks == (64 << 20) // (per_token * block_size)
    # start-up names the compute path: which backend, on which instruction sets, and the batch-invariance mode
    from tokenmill.model.cpu_kernels import cpu_isa

    backend = re.search(r"^backend: (.*)$", proc.stderr, re.MULTILINE)
    assert backend and backend.group(1).endswith("; batch-invariant"), proc.stderr
    assert ("isa: " + (cpu_isa() or "baseline")) in backend.group(1) or backend.group(1).startswith("torch")


@pytest.mark.slow
def test_chat_over_stdin_answers_the_quickstart_questions_on_the_default_path():
    """The README's first chat, greedy, on this CPU's default path (dtype auto, the GGUF file's blocks kept where
    their kernel runs): the answers are the model's own (a path whose rounding flips them is not a default)."""
    proc = tokenmill("chat", "--max-tokens", "16", "--temperature", "0", "--kv-cache-memory", "64MiB",
                     input="What is the capital of France?\n\n")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    reply = proc.stdout.replace("> ", "").strip()  # input() writes its prompt to stdout when stdin is a pipe
    assert "Paris" in reply, (reply, proc.stderr)
    assert "KV cache:" in proc.stderr


# ---- flag errors -------------------------------------------------------------------------------------------


def test_missing_model_is_a_one_line_error():
    line = assert_one_line_error(tokenmill("generate", "hi", "--model", "/nonexistent"), "/nonexistent")
    assert "exist" in line


def test_max_tokens_zero_is_a_one_line_error(tiny_dir):
    assert_one_line_error(tokenmill("generate", "hi", "--model", tiny_dir, "--max-tokens", "0"), "--max-tokens")


def test_negative_temperature_is_a_one_line_error(tiny_dir):
    proc = tokenmill("generate", "hi", "--model", tiny_dir, "--temperature", "-1")
    assert_one_line_error(proc, "--temperature")


def test_bad_engine_flag_is_a_one_line_error(tiny_dir):
    proc = tokenmill("generate", "hi", "--model", tiny_dir, "--block-size", "0")
    assert_one_line_error(proc, "--block-size")


def test_zero_threads_is_a_one_line_error(tiny_dir):
    proc = tokenmill("generate", "hi", "--model", tiny_dir, "--threads", "0")
    assert_one_line_error(proc, "--threads")


def test_unparsable_byte_count_is_a_usage_error():
    proc = tokenmill("generate", "hi", "--kv-cache-memory", "lots")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "--kv-cache-memory" in proc.stderr and "lots" in proc.stderr


def test_overflowing_byte_count_is_a_usage_error():
    proc = tokenmill("generate", "hi", "--kv-cache-memory", "1e400")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2
    assert "--kv-cache-memory" in proc.stderr


def test_generate_runs_on_a_model_directory(tiny_dir):
    proc = tokenmill("generate", "Hello", "--model", tiny_dir, "--max-tokens", "5", "--temperature", "0",
                     "--kv-cache-memory", "8MiB", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "bytes per token (float32)" in proc.stderr


# ---- parse_bytes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("2GiB", 2 * 1024 ** 3),
    ("512M", 512 * 1024 ** 2),
    ("512MiB", 512 * 1024 ** 2),
    ("512MB", 512 * 1000 ** 2),
    ("1e9", 10 ** 9),
    ("64MiB", 64 << 20),
    ("100", 100),
    ("1.5K", 1536),
    ("2gib", 2 << 30),
    (" 3 GiB ", 3 << 30),
    ("1T", 1 << 40),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["lots", "", "12X", "-5", "2GiBs", "1 2", "e", "1..2"])
def test_parse_bytes_rejects_garbage(text):
    # argparse turns either exception into a usage error naming the flag.
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        parse_bytes(text)


def test_parse_bytes_rejects_infinity_as_a_usage_error():
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        parse_bytes("1e400")


def test_server_settings_default_body_limit_is_the_flags():
    from tokenmill.cli import build_parser
    from tokenmill.server.app import ServerSettings

    args = build_parser().parse_args(["serve"])
    assert ServerSettings(["m"]).max_request_bytes == args.max_request_bytes == 16 << 20


def test_server_settings_default_priority_range_lets_clients_only_lower_their_standing():
    from tokenmill.cli import build_parser
    from tokenmill.errors import InvalidRequest
    from tokenmill.server.app import ServerSettings

    args = build_parser().parse_args(["serve"])
    settings = ServerSettings(["m"], client_priority_range=args.client_priority_range)
    assert args.client_priority_range == ServerSettings(["m"]).client_priority_range == (0, None)
    settings.check_priority(0)
    settings.check_priority(10**6)
    with pytest.raises(InvalidRequest, match="--client-priority-range 0:"):
        settings.check_priority(-1)


@pytest.mark.parametrize("text,bounds", [("0:", (0, None)), ("-10:10", (-10, 10)), ("3:3", (3, 3)), (" -1 : ", (-1, None))])
def test_parse_priority_range(text, bounds):
    from tokenmill.server.settings import parse_priority_range

    assert parse_priority_range(text) == bounds


@pytest.mark.parametrize("text", ["", "5", "a:b", "3:1", ":5"])
def test_bad_priority_range_is_a_usage_error_naming_the_flag(text):
    r = tokenmill("serve", "--client-priority-range", text)
    assert r.returncode == 2 and "--client-priority-range" in r.stderr and "LO:HI" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--prefill", "http://a:1"], "--prefill and --decode go together"),
    (["--prefill", "http://a:1", "--decode", "http://b:1", "--backend", "http://c:1"], "do not mix"),
    (["--prefill", "ftp://a", "--decode", "http://b:1"], "http(s) URL"),
])
def test_router_prefill_decode_flags_are_checked(args, message):
    r = tokenmill("router", *args)
    assert r.returncode == 2 and message in r.stderr
