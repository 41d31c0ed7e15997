"""`python -m tokenmill` is the `tokenmill` command line: the same parser, the same exit codes (for environments
where the console script is not on PATH)."""

from __future__ import annotations

import os
import subprocess
import sys

from tokenmill.cli import build_parser

TIMEOUT = 120


def python_m_tokenmill(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, check=False)


def test_help_is_the_cli_help(monkeypatch):
    proc = python_m_tokenmill("--help")
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width: the subprocess's
    assert proc.stdout == build_parser().format_help()


def test_a_flag_error_exits_2_with_one_error_line():
    """main()'s return value is the exit status: a bad flag fails before any model loads."""
    proc = python_m_tokenmill("generate", "--max-tokens", "0", "hello")
    assert proc.returncode == 2, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: --max-tokens must be an integer >= 1"]
    assert "Traceback" not in proc.stderr
