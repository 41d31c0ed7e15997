"""Result records, their files and the printed summary."""

from __future__ import annotations

import json
import math

import pytest

from tokenmill.bench.metrics import RequestClass, RequestResult, calculate_metrics, class_metrics
from tokenmill.bench.report import format_result, load_result, save_result, serve_result


def _result(n_tokens: int, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, prompt_len=10, ttft=0.2, itl=[0.05] * (n_tokens - 1),
                         latency=0.2 + 0.05 * (n_tokens - 1), output_tokens=n_tokens, error="" if ok else "HTTP 503")


@pytest.fixture
def record():
    results = [_result(8), _result(5), _result(8, ok=False)]
    metrics, lens = calculate_metrics(results, 2.0, slo_ttft_ms=500)
    config = {"label": "sys", "request_rate": math.inf, "slo_ms": {"ttft": 500, "tpot": None}}
    return serve_result(config, metrics, results, lens, expected_lens=[8, 8, 8])


def test_serve_record_keeps_per_request_samples(record):
    assert record["kind"] == "serve" and record["request_rate"] == "inf"
    assert record["ttfts"] == [0.2, 0.2, None] and record["itls"][2] is None and len(record["itls"][0]) == 7
    assert record["output_lens"] == [8, 5, 0] and record["short_outputs"] == 1  # the failed one is not "short"
    assert record["errors"] == ["", "", "HTTP 503"]


def test_round_trip_and_summary(record, tmp_path):
    path = save_result(record, tmp_path / "sub" / "r.json")
    json.loads(path.read_text())  # strict JSON: no NaN or Infinity
    again = load_result(path)
    assert again == json.loads(json.dumps(record))
    text = format_result(again)
    for line in ("Successful requests:                     2", "Failed requests:                         1",
                 "Requests cut short (< max_tokens):       1", "Request goodput (req/s) [ttft <= 500 ms]:",
                 "P99 ITL (ms):", "First error (1 failed): HTTP 503", "Request rate configured (RPS):           inf"):
        assert line in text, text


def test_load_result_refuses_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a tokenmill bench result"):
        load_result(path)


def test_classes_are_saved_and_printed(tmp_path):
    results = [_result(8), _result(5), _result(8, ok=False), _result(3)]
    labels = ["interactive", "batch", "batch", "interactive"]
    classes = [RequestClass("interactive", share=3, priority=0, slo_ttft_ms=100, slo_tpot_ms=150),
               RequestClass("batch", share=1, priority=1)]
    metrics, lens = calculate_metrics(results, 2.0, slo_ttft_ms=500)
    per_class = class_metrics(results, lens, labels, classes, 2.0, slo_ttft_ms=500)
    record = serve_result({"label": "mix", "request_rate": 4.0}, metrics, results, lens, None, per_class, labels)
    again = load_result(save_result(record, tmp_path / "mix.json"))
    assert again["request_classes"] == labels
    assert list(again["classes"]) == ["interactive", "batch"]
    inter, batch = again["classes"]["interactive"], again["classes"]["batch"]
    assert inter["request_goodput"] == 0.0  # TTFT 200 ms misses its own 100 ms target...
    assert batch["request_goodput"] == pytest.approx(0.5)  # ...and meets the run's 500 ms one
    assert (batch["completed"], batch["failed"], batch["priority"], batch["share"]) == (1, 1, 1, 0.25)
    lines = format_result(again).splitlines()
    start = next(i for i, line in enumerate(lines) if "Per Request Class" in line)
    header, inter_row, batch_row = (line.split() for line in lines[start + 1:start + 4])
    assert header[:4] == ["class", "prio", "ok", "failed"]
    # class, prio, ok, failed, TTFT p50/p99, TPOT p50/p99, out tok/s, goodput, SLO ttft/tpot
    assert inter_row == ["interactive", "0", "2", "0", "200.00", "200.00", "50.00", "50.00", "5.50", "0.00",
                         "100/150"]
    assert batch_row == ["batch", "1", "1", "1", "200.00", "200.00", "50.00", "50.00", "2.50", "0.50", "500/-"]


def test_a_run_without_classes_has_no_class_table(record):
    assert "classes" not in record and "request_classes" not in record
    assert "Per Request Class" not in format_result(record)
