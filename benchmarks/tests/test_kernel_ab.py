"""benchmarks/kernel_ab.py's logic (no kernels built here): the interleaving, the equality gate, its arguments."""

import sys

import pytest
import torch

from benchmarks.tests.scripts import load_benchmark_script

kernel_ab = load_benchmark_script("kernel_ab.py")


def test_interleaved_calls_the_builds_in_turn_and_returns_one_median_each():
    calls = []
    medians = kernel_ab.interleaved([lambda: calls.append("old"), lambda: calls.append("new")], rounds=3)
    assert calls == ["old", "new"] * 3
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_differing_outputs_stop_the_comparison_unless_allowed(capsys):
    a, b = torch.zeros(4), torch.tensor([0.0, 0.0, 0.5, 0.0])
    kernel_ab.check_equal(a, a.clone(), "same", allow=False)  # equal: nothing happens
    with pytest.raises(SystemExit, match="outputs differ"):
        kernel_ab.check_equal(a, b, "matmul", allow=False)
    kernel_ab.check_equal(a, b, "matmul", allow=True)
    assert "max |diff| 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--old", ".", "--parts", "matmul,bogus"], "unknown parts"),
    (["--old", "/nonexistent"], "not a tokenmill checkout"),
])
def test_bad_arguments_name_the_fix(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["kernel_ab.py", *argv])
    with pytest.raises(SystemExit):
        kernel_ab.main()
    assert message in capsys.readouterr().err
