"""`tokenmill bench`: flag errors, a short real run against a `tokenmill serve` process, plots, offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest

from tokenmill.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMEOUT = 240


# One compute thread for the servers and engines these tests start: speed is not tested here, and on a busy
# 2-core machine two threads per process oversubscribe the cores and make every step many times slower.
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def tokenmill(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, check=False)


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; it must exit 2 with exactly one `error: ...` line on stderr."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv,flag", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "-2"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--dataset", "imagenet"], "--dataset"),
    (["--burstiness", "0"], "--burstiness"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--endpoint", "embeddings"], "--endpoint"),
    (["--extra-body", "{nope"], "--extra-body"),
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms"),
    (["--base-url", "127.0.0.1:8000"], "--base-url"),
    (["--base-url", "http://127.0.0.1:9"], "--base-url"),  # nothing listens on the discard port
])
def test_bad_serve_flags_are_one_line_errors(capsys, argv, flag):
    assert flag in one_line_error(capsys, ["bench", "serve", *argv])


def test_request_class_specs_parse():
    from tokenmill.bench.cli import parse_request_class
    from tokenmill.bench.metrics import RequestClass

    assert parse_request_class("interactive:share=0.75,priority=0,slo_ttft_ms=1000,slo_tpot_ms=150") == \
        RequestClass("interactive", share=0.75, priority=0, slo_ttft_ms=1000.0, slo_tpot_ms=150.0)
    assert parse_request_class(" batch : share = 0.25 , priority=-1 ,") == \
        RequestClass("batch", share=0.25, priority=-1)
    assert parse_request_class("plain") == RequestClass("plain", share=1.0)


@pytest.mark.parametrize("specs,message", [
    (["i:share=1,speed=2"], "class 'i': unknown key 'speed'; keys are share, priority, slo_ttft_ms, slo_tpot_ms"),
    (["i:share=lots"], "class 'i': share must be a positive number, got 'lots'"),
    (["i:share=0"], "class 'i': share must be a positive number, got '0'"),
    (["i:slo_ttft_ms=-5"], "class 'i': slo_ttft_ms must be a positive number, got '-5'"),
    (["i:slo_tpot_ms=inf"], "class 'i': slo_tpot_ms must be a positive number, got 'inf'"),
    (["i:priority=0.5"], "class 'i': priority must be an integer, got '0.5'"),
    (["i:share"], "class 'i': 'share' is not key=value"),
    (["i:share=1,share=2"], "class 'i': share given twice"),
    (["i:share=1", "b", "i:share=2"], "class 'i' is given twice"),
    ([":share=1"], "missing class name in ':share=1'"),
    (["share=0.5,priority=1"], "missing class name"),
    (["a b:share=1"], "class name 'a b' may hold only"),
])
def test_bad_request_class_is_a_one_line_error(capsys, specs, message):
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]  # refused before any connection is tried
    for spec in specs:
        argv += ["--request-class", spec]
    line = one_line_error(capsys, argv)
    assert line.startswith("error: --request-class: ") and message in line, line


def test_bad_plot_input_is_a_one_line_error(capsys, tmp_path):
    not_result = tmp_path / "x.json"
    not_result.write_text("[1, 2]")
    assert "x.json" in one_line_error(capsys, ["bench", "plot", str(not_result), "--out", str(tmp_path)])
    assert "missing.json" in one_line_error(capsys, ["bench", "plot", str(tmp_path / "missing.json")])


def test_bad_offline_flag_fails_before_loading_a_model(capsys):
    assert "--random-output-len" in one_line_error(capsys, ["bench", "offline", "--random-output-len", "0",
                                                            "--model", "/nonexistent"])


# --------------------------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def server():
    from tests.server.conftest import start_server

    with pytest.MonkeyPatch.context() as mp:
        for name, value in QUIET_ENV.items():
            mp.setenv(name, value)
        s = start_server("--max-num-seqs", "16")
    try:
        yield s
    finally:
        s.stop()


def metrics_text(server) -> str:
    import httpx

    return httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text


def slo_requests(text: str) -> Counter:
    """tokenmill_slo_requests_total by (priority, outcome), from the server's Prometheus text."""
    counts: Counter = Counter()
    for line in text.splitlines():
        if line.startswith("tokenmill_slo_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            counts[labels["priority"], labels["outcome"]] += int(float(line.rsplit(" ", 1)[1]))
    return counts


@pytest.mark.slow
def test_serve_run_writes_a_complete_result_and_plots(server, tmp_path):
    from tests.server.conftest import API_KEY

    result_path = tmp_path / "run.json"
    slo_before = slo_requests(metrics_text(server))
    proc = tokenmill("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--dataset", "random",
                     "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "8",
                     "--request-rate", "inf", "--seed", "3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                     "--request-class", "interactive:share=0.75,priority=0,slo_ttft_ms=50000,slo_tpot_ms=40000",
                     "--request-class", "batch:share=0.25,priority=1",
                     "--label", "tokenmill-test", "--save-result", str(result_path), "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr
    for heading in ("Successful requests:", "Median TTFT (ms):", "P99 ITL (ms):", "Request goodput",
                    "Per Request Class", "50000/40000", "60000/60000"):
        assert heading in proc.stdout, proc.stdout

    result = json.loads(result_path.read_text())
    assert result["kind"] == "serve" and result["label"] == "tokenmill-test"
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["model"] == server.model and result["base_url"] == server.url
    assert result["request_rate"] == "inf" and result["dataset"] == "random" and result["num_prompts"] == 8
    assert len(result["ttfts"]) == 8 and all(t > 0 for t in result["ttfts"])
    assert len(result["itls"]) == 8 and all(len(gaps) == 7 for gaps in result["itls"]), result["itls"]
    assert result["output_lens"] == [8] * 8  # ignore_eos + max_tokens, counted from the usage chunk
    assert result["expected_output_lens"] == [8] * 8 and result["short_outputs"] == 0
    assert result["total_output_tokens"] == 64 and result["output_throughput"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    # two classes, 6 + 2 of the 8 requests, each with its own targets (batch falls back to the global ones)
    assert sorted(result["request_classes"]) == ["batch"] * 2 + ["interactive"] * 6
    classes = result["classes"]
    assert list(classes) == ["interactive", "batch"]
    assert (classes["interactive"]["requests"], classes["batch"]["requests"]) == (6, 2)
    assert classes["interactive"]["priority"] == 0 and classes["batch"]["priority"] == 1
    assert classes["interactive"]["slo_ttft_ms"] == 50000 and classes["batch"]["slo_tpot_ms"] == 60000
    assert classes["interactive"]["request_goodput"] + classes["batch"]["request_goodput"] == \
        pytest.approx(result["request_goodput"])
    assert classes["batch"]["p99_ttft_ms"] >= classes["batch"]["median_ttft_ms"] > 0
    # the server saw each class's priority and targets: only interactive requests carry SLOs, at priority 0
    probe = 1 if result["request_classes"][0] == "interactive" else 0  # the test request is request 0's class
    assert slo_requests(metrics_text(server)) - slo_before == {("0", "met"): 6 + probe}

    # a second run (another label, a finite rate) so the against-rate charts have something to compare
    second = dict(result, label="other", request_rate=2.0, output_throughput=result["output_throughput"] / 2)
    second_path = tmp_path / "second.json"
    second_path.write_text(json.dumps(second))
    out = tmp_path / "plots"
    proc = tokenmill("bench", "plot", str(result_path), str(second_path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in out.iterdir())
    assert written == ["itl_cdf.png", "p99_ttft_vs_rate.png", "throughput_vs_rate.png", "ttft_cdf.png"]
    for name in written:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


@pytest.mark.slow
def test_chat_endpoint_with_concurrency_cap(server, tmp_path):
    from tests.server.conftest import API_KEY

    result_path = tmp_path / "chat.json"
    proc = tokenmill("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--endpoint", "chat",
                     "--dataset", "prefix-sharing", "--prefix-num-groups", "2", "--prefix-len", "24",
                     "--prefix-question-len", "8", "--prefix-output-len", "4", "--num-prompts", "4",
                     "--max-concurrency", "2", "--request-rate", "50", "--save-result", str(result_path),
                     "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(result_path.read_text())
    assert result["completed"] == 4 and result["endpoint"] == "chat" and result["max_concurrency"] == 2
    # the chat template wraps the prompt, and the server's usage count says so
    assert all(n > 32 for n in result["input_lens"]), result["input_lens"]
    assert result["output_lens"] == [4] * 4


@pytest.mark.slow
def test_wrong_model_name_fails_the_test_request(server):
    from tests.server.conftest import API_KEY

    proc = tokenmill("bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--model", "no-such-model",
                     "--dataset", "random", "--random-input-len", "8", "--random-output-len", "2",
                     "--num-prompts", "2", "--disable-tqdm")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "test request" in errors[0] and "404" in errors[0], proc.stderr


def test_offline_run_on_a_tiny_model(tmp_path):
    from tests.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path, arch="llama", num_heads=4, num_kv_heads=2)
    result_path = tmp_path / "offline.json"
    proc = tokenmill("bench", "offline", "--model", str(model), "--dtype", "float32", "--dataset", "random",
                     "--random-input-len", "16", "--random-output-len", "5", "--num-prompts", "6",
                     "--kv-cache-memory", "64MiB", "--save-result", str(result_path), "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr
    assert "Output token throughput (tok/s):" in proc.stdout
    result = json.loads(result_path.read_text())
    assert result["kind"] == "offline" and result["completed"] == 6
    assert result["total_output_tokens"] == 30 and result["output_lens"] == [5] * 6
    assert result["total_input_tokens"] == 96 and result["output_throughput"] > 0
    assert result["engine"]["dtype"] == "float32"


def test_tokenizer_flag_takes_a_tokenizer_only_directory(tmp_path):
    from tests.models.tiny import smollm2_tokenizer
    from tokenmill.bench.cli import BenchUsageError, load_tokenizer

    smollm2_tokenizer().save_pretrained(tmp_path)  # no config.json, no weights
    assert load_tokenizer(str(tmp_path)).encode("Hello world", add_special_tokens=False)
    with pytest.raises(BenchUsageError, match="^--tokenizer: cannot load"):
        load_tokenizer(str(tmp_path / "missing"))
