"""benchmarks/compare.py without running any server: peer selection, skipping, and the markdown table."""

from __future__ import annotations

import pytest

from benchmarks.tests.scripts import load_benchmark_script


@pytest.fixture(scope="module")
def compare():
    return load_benchmark_script("compare.py")


def test_missing_peers_are_skipped_with_a_reason(compare, tmp_path):
    args = compare.parse_args(["--peers", "tokenmill,llamacpp,llamacpp-python,vllm",
                               "--llama-server", "/nonexistent/llama-server", "--llamacpp-python", "/nonexistent/python",
                               "--request-rates", "2,inf"])
    assert args.rates == [2.0, float("inf")]
    peers, skipped = compare.make_peers(args, tmp_path)
    assert [p.name for p in peers] == ["tokenmill"]
    assert "{port}" in peers[0].command and "--served-model-name" in peers[0].command
    assert any(s.startswith("llama.cpp: not installed") and "build_llama_server.sh" in s for s in skipped)
    assert any(s.startswith("llama-cpp-python: not installed") for s in skipped)
    assert any(s.startswith("vLLM: no --vllm-venv") for s in skipped)


def test_llama_server_command(compare, tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 1 (abc1234)' >&2\n")
    binary.chmod(0o755)
    args = compare.parse_args(["--peers", "llamacpp", "--llama-server", str(binary), "--max-concurrency", "4",
                               "--threads", "3"])
    (peer,), skipped = compare.make_peers(args, tmp_path)
    assert not skipped and peer.label == "llama.cpp" and peer.ready_path == "/health"
    cmd = peer.command
    assert cmd[0] == str(binary) and "{port}" in cmd and cmd[cmd.index("--alias") + 1] == compare.SERVED_NAME
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == str(4 * 4096) and "-cb" in cmd
    assert cmd[cmd.index("-t") + 1] == cmd[cmd.index("-tb") + 1] == "3"
    assert cmd[cmd.index("--model") + 1].endswith(".gguf") and "abc1234" in peer.notes
    # no --max-concurrency: 16 slots; many slots: the total context is capped, never below 2048 a slot
    assert compare.llama_server_slots(compare.parse_args([])) == (16, 4096)
    assert compare.llama_server_slots(compare.parse_args(["--max-concurrency", "64"])) == (64, 2048)
    assert compare.llama_server_slots(compare.parse_args(["--llamacpp-parallel", "256"])) == (256, 2048)


def test_unknown_peer_and_bad_rates_are_refused(compare, tmp_path):
    with pytest.raises(SystemExit, match="unknown peer 'sglang'"):
        compare.make_peers(compare.parse_args(["--peers", "sglang"]), tmp_path)
    with pytest.raises(SystemExit):
        compare.parse_args(["--request-rates", "0,1"])


def test_markdown_table_rows(compare):
    serve = {"kind": "serve", "label": "tokenmill", "request_rate": "inf", "completed": 8, "failed": 0,
             "duration": 2.5, "request_throughput": 3.2, "output_throughput": 25.6, "median_ttft_ms": 812.4,
             "p99_ttft_ms": 1500.0, "median_tpot_ms": 50.0, "median_itl_ms": 49.0, "p99_itl_ms": 120.0,
             "median_e2el_ms": 1200.0}
    slow = dict(serve, label="llama.cpp", request_rate=1.0, failed=1, median_tpot_ms=None)
    offline = {"kind": "offline", "label": "transformers (offline, batches of 16)", "completed": 8, "duration": 9.0,
               "request_throughput": 0.9, "output_throughput": 7.1}
    table = compare.markdown_table([offline, slow, serve]).splitlines()
    assert table[0].startswith("| system | rate") and set(table[1]) == {"|", "-"}
    assert table[1].count("|") == table[0].count("|")
    assert all(row.count("|") == table[0].count("|") for row in table[2:])
    assert table[2].startswith("| tokenmill | inf | 8 / 0 | 2.5 | 3.20 | 25.6 | 812 / 1,500 | 50 |")
    assert table[3].startswith("| llama.cpp | 1 | 8 / 1 |") and "| – |" in table[3]
    assert table[4].startswith("| transformers (offline, batches of 16) | offline |")


def test_hf_row_uses_the_bench_workload(compare):
    from tokenmill.bench.datasets import DatasetOptions

    args = compare.parse_args(["--dataset", "random", "--random-input-len", "32", "--num-prompts", "3",
                               "--seed", "4"])
    opts = compare.dataset_options(args)
    assert opts == DatasetOptions(name="random", num_prompts=3, seed=4, random_input_len=32)
