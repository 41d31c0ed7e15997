"""A parallel LLM's life in a script of its own (a subprocess, as a user runs one): shut down by `shutdown()`, by
the with-statement, by garbage collection or by the interpreter's exit, it ends its ranks quietly and promptly, and
the next parallel LLM of the same process starts and gives the same tokens. Two at once are refused by name, and a
rank that dies while in use is still reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill import LLM
from tokenmill.errors import ConfigError

TIMEOUT = 240

PREAMBLE = """
import json, os, signal, sys
from tokenmill import LLM, SamplingParams

KW = json.loads(sys.argv[1])
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tokens(llm):
    return llm.generate({"prompt_token_ids": [5, 17, 99, 42, 7]}, PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def worker_pids(llm):
    return [p.pid for p in llm.engine.core.executor.ranks.procs]
"""

FOUR_LIVES = """
first = LLM(**KW)
seen, pids = [tokens(first)], worker_pids(first)
first.shutdown()
first.shutdown()
with LLM(**KW) as second:
    seen.append(tokens(second))
    pids += worker_pids(second)
third = LLM(**KW)
seen.append(tokens(third))
pids += worker_pids(third)
del third  # garbage collected: its ranks end with it
fourth = LLM(**KW)  # never shut down: the interpreter's exit ends its ranks
seen.append(tokens(fourth))
pids += worker_pids(fourth)
print(json.dumps({"tokens": seen, "pids": pids}))
"""

NEVER_SHUT_DOWN = """
import time

llm = LLM(**KW)
print(json.dumps({"tokens": [tokens(llm)], "pids": worker_pids(llm), "ended_at": time.time()}))
"""

RANK_KILLED_IN_USE = """
llm = LLM(**KW)
tokens(llm)
rank1 = llm.engine.core.executor.ranks.procs[0]
os.kill(rank1.pid, signal.SIGKILL)
rank1.wait(10)
tokens(llm)
"""

INTERRUPTED = """
llm = LLM(**KW)
print(json.dumps({"pids": worker_pids(llm)}), flush=True)
long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
llm.generate([{"prompt_token_ids": [5, 17, 99]}] * 32, long, use_tqdm=False)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lifecycle"), num_heads=4, num_kv_heads=2, vocab_size=256)


def engine_kwargs(model: Path, **parallel: int) -> dict:
    return {"model": str(model), "dtype": "float32", "kv_cache_memory": 4 << 20, "num_threads": 1, **parallel}


def run_script(body: str, kwargs: dict) -> tuple[subprocess.CompletedProcess, float]:
    """The script's result and its run time; stderr is read to its end, so a rank that outlives the script and
    prints later is caught too."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PREAMBLE + body), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env, check=False)
    return proc, time.monotonic() - start


def running(pid: int) -> bool:
    """Whether a process runs (a zombie, or one gone, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def assert_ended_quietly(proc: subprocess.CompletedProcess) -> dict:
    """Exit 0, nothing alarming on stderr, every rank ended before the script did; the script's report."""
    assert proc.returncode == 0, proc.stderr
    noisy = [line for line in proc.stderr.splitlines() if "ERROR" in line or "failed" in line or "Traceback" in line]
    assert not noisy, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not [pid for pid in out["pids"] if running(pid)]
    return out


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_four_parallel_llms_in_turn_give_the_same_tokens_and_end_quietly(model, parallel):
    out = assert_ended_quietly(run_script(FOUR_LIVES, engine_kwargs(model, **parallel))[0])
    assert len(out["tokens"]) == 4 and all(t == out["tokens"][0] for t in out["tokens"]), out["tokens"]
    assert len(out["tokens"][0]) == 6


def test_a_script_that_never_shuts_down_ends_quietly_and_promptly(model):
    """The interpreter's exit stops the ranks: no rank left to find rank 0 gone and say so after the script."""
    proc, _ = run_script(NEVER_SHUT_DOWN, engine_kwargs(model, tensor_parallel_size=2))
    ended = time.time()
    out = assert_ended_quietly(proc)
    assert ended - out["ended_at"] < 8  # the ranks stop when told (10 s is when they would be killed)


def test_a_rank_killed_in_use_is_reported(model):
    proc, _ = run_script(RANK_KILLED_IN_USE, engine_kwargs(model, tensor_parallel_size=2))
    assert proc.returncode == 1
    assert "ParallelFailure: a tensor-parallel forward pass failed" in proc.stderr
    assert "parallel rank 1" in proc.stderr and "exited with code -9" in proc.stderr


def test_ctrl_c_mid_generation_ends_the_script_and_its_ranks_within_seconds(model):
    """Interrupted inside a call of every rank, the other ranks cannot take a stop: they are killed, not waited
    for (and a rank never reports rank 0's exit as its failure)."""
    script = textwrap.dedent(PREAMBLE + INTERRUPTED)
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(engine_kwargs(model, tensor_parallel_size=2))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        pids = json.loads(proc.stdout.readline())["pids"]
        time.sleep(1.5)  # well into the generation
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert time.monotonic() - start < 8, stderr
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in stderr
    assert not [line for line in stderr.splitlines() if "ERROR" in line or "parallel rank" in line], stderr
    assert not [pid for pid in pids if running(pid)]


def test_a_second_parallel_llm_while_the_first_runs_is_refused_by_name(model):
    first = LLM(**engine_kwargs(model, tensor_parallel_size=2))
    try:
        with pytest.raises(ConfigError, match=r"already runs a parallel engine.*llm\.shutdown\(\)"):
            LLM(**engine_kwargs(model, tensor_parallel_size=2))
        assert first.engine.core.executor.ranks.dead() == []  # the refusal touched nothing of the first
    finally:
        first.shutdown()
    with LLM(**engine_kwargs(model, tensor_parallel_size=2)) as again:
        assert again.engine.core.executor.ranks is not None
