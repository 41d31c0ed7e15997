"""`tokenmill bench serve | offline | plot`: the serving benchmark's commands (their flags are defined in
bench/cli_args.py).

Flags are checked before anything slow happens (tokenizer, model, network) and every mistake ends the same
way as the rest of the CLI: exit status 2 and one `error: ...` line naming the flag, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.bench.datasets import DATASETS, DatasetOptions, sample_requests

if TYPE_CHECKING:
    from tokenmill.bench.metrics import RequestClass

log = logging.getLogger(__name__)


class BenchUsageError(Exception):
    """A flag (or what it points at) is wrong; the message starts with the flag's name."""


# ----------------------------------------------------------------------------------------- validation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BenchUsageError(message)


def dataset_options(args: argparse.Namespace) -> DatasetOptions:
    """The workload flags, checked; errors name the flag."""
    _require(args.dataset in DATASETS, f"--dataset: unknown dataset {args.dataset!r}; choose from "
                                       f"{', '.join(DATASETS)}")
    _require(args.num_prompts >= 1, f"--num-prompts must be at least 1, got {args.num_prompts}")
    positive = {"--random-input-len": args.random_input_len, "--random-output-len": args.random_output_len,
                "--prefix-num-groups": args.prefix_num_groups, "--prefix-len": args.prefix_len,
                "--prefix-question-len": args.prefix_question_len, "--prefix-output-len": args.prefix_output_len,
                "--sharegpt-max-prompt-len": args.sharegpt_max_prompt_len,
                "--sharegpt-max-output-len": args.sharegpt_max_output_len}
    if args.sharegpt_output_len is not None:
        positive["--sharegpt-output-len"] = args.sharegpt_output_len
    for flag, value in positive.items():
        _require(value >= 1, f"{flag} must be at least 1, got {value}")
    _require(0.0 <= args.random_range_ratio < 1.0,
             f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.sharegpt_path is not None:
        _require(Path(args.sharegpt_path).is_file(), f"--sharegpt-path: no file at {args.sharegpt_path}")
    return DatasetOptions(
        name=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, prefix_num_groups=args.prefix_num_groups,
        prefix_len=args.prefix_len, prefix_question_len=args.prefix_question_len,
        prefix_output_len=args.prefix_output_len, sharegpt_max_prompt_len=args.sharegpt_max_prompt_len,
        sharegpt_max_output_len=args.sharegpt_max_output_len, sharegpt_output_len=args.sharegpt_output_len,
        sharegpt_path=args.sharegpt_path)


def _check_serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Checks the load flags; returns the parsed --extra-body."""
    rate, burst = args.request_rate, args.burstiness
    _require(rate > 0 and not math.isnan(rate), f"--request-rate must be positive or inf, got {rate:g}")
    _require(burst > 0 and not math.isnan(burst), f"--burstiness must be positive, got {burst:g}")
    _require(args.max_concurrency is None or args.max_concurrency >= 1,
             f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        _require(value is None or value > 0, f"{flag} must be positive, got {value}")
    _require(args.endpoint in ("completions", "chat"),
             f"--endpoint: unknown endpoint {args.endpoint!r}; choose from completions, chat")
    _require(args.base_url.startswith(("http://", "https://")),
             f"--base-url must start with http:// or https://, got {args.base_url!r}")
    extra: Any = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise BenchUsageError(f"--extra-body is not valid JSON: {e}") from None
        _require(isinstance(extra, dict), "--extra-body must be a JSON object")
    return extra


CLASS_KEYS = ("share", "priority", "slo_ttft_ms", "slo_tpot_ms")
_CLASS_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_request_class(spec: str) -> RequestClass:
    """One `--request-class NAME:key=value,...`, checked; errors start with the flag and name the class."""
    from tokenmill.bench.metrics import RequestClass

    name, _, rest = (part.strip() for part in spec.partition(":"))
    _require(bool(name) and "=" not in name,
             f"--request-class: missing class name in {spec!r}; write NAME:key=value,...")
    _require(_CLASS_NAME.fullmatch(name) is not None,
             f"--request-class: class name {name!r} may hold only letters, digits, '_', '-' and '.'")
    where = f"--request-class: class {name!r}"
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        _require(bool(eq), f"{where}: {item!r} is not key=value")
        _require(key in CLASS_KEYS, f"{where}: unknown key {key!r}; keys are {', '.join(CLASS_KEYS)}")
        _require(key not in fields, f"{where}: {key} given twice")
        fields[key] = _class_value(where, key, value)
    return RequestClass(name, **fields)


def _class_value(where: str, key: str, text: str) -> int | float:
    if key == "priority":
        try:
            return int(text)
        except ValueError:
            raise BenchUsageError(f"{where}: priority must be an integer, got {text!r}") from None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    _require(value > 0 and math.isfinite(value), f"{where}: {key} must be a positive number, got {text!r}")
    return value


def request_classes(args: argparse.Namespace) -> list[RequestClass]:
    """Every --request-class, checked (names unique); empty when the load is not mixed."""
    classes = [parse_request_class(spec) for spec in args.request_class or []]
    names = [c.name for c in classes]
    twice = next((n for n in names if names.count(n) > 1), None)
    _require(twice is None, f"--request-class: class {twice!r} is given twice")
    return classes


# ----------------------------------------------------------------------------------------------- commands


def _run(func, args: argparse.Namespace) -> int:
    logging.getLogger("tokenmill.bench").setLevel(logging.INFO)  # dataset record counts are worth seeing
    try:
        return func(args)
    except BenchUsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_serve(args: argparse.Namespace) -> int:
    return _run(_serve, args)


def cmd_offline(args: argparse.Namespace) -> int:
    return _run(_offline, args)


def cmd_plot(args: argparse.Namespace) -> int:
    return _run(_plot, args)


def load_tokenizer(path: str | None) -> Any:
    from tokenmill.errors import TokenmillError
    from tokenmill.model.paths import resolve_model_path
    from tokenmill.tokenizer import Tokenizer

    try:  # a tokenizer-only directory is fine here, so only the default goes through the model resolver
        return Tokenizer.load(Path(path).expanduser() if path else resolve_model_path(None))
    except (TokenmillError, OSError, ValueError) as e:
        raise BenchUsageError(f"--tokenizer: cannot load a tokenizer from {path or 'the default model'}: {e}") \
            from None


def _sample(opts: DatasetOptions, tokenizer: Any) -> list:
    try:
        requests = sample_requests(opts, tokenizer)
    except FileNotFoundError as e:
        raise BenchUsageError(f"--dataset {opts.name}: {e}") from None
    except ValueError as e:
        raise BenchUsageError(f"--dataset {opts.name}: {e}") from None
    if not requests:
        raise BenchUsageError(f"--dataset {opts.name}: no request passes the length filters")
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    print(f"workload: {len(requests)} {opts.name} requests, mean prompt {mean_in:.0f} tokens, "
          f"mean output {mean_out:.0f} tokens (seed {opts.seed})", file=sys.stderr)
    return requests


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.bench.loadgen import LoadConfig, ServerUnreachable, first_model, run_load, send_request
    from tokenmill.bench.metrics import calculate_metrics, class_metrics
    from tokenmill.bench.report import format_serve, save_result, serve_result
    from tokenmill.bench.spec_metrics import delta, format_spec, scrape

    extra_body = _check_serve_flags(args)
    classes = request_classes(args)
    opts = dataset_options(args)
    base_url = args.base_url.rstrip("/")
    try:
        model = args.model or first_model(base_url, args.api_key)
    except ServerUnreachable as e:
        raise BenchUsageError(f"--base-url {base_url}: {e}") from None
    tokenizer = load_tokenizer(args.tokenizer)
    requests = _sample(opts, tokenizer)
    assignment, bodies = _assign_classes(classes, len(requests), args.seed)
    if args.lora_modules:  # request i goes to adapter i mod N
        bodies = [{**(bodies[i] if bodies else {}), "model": args.lora_modules[i % len(args.lora_modules)]}
                  for i in range(len(requests))]
    cfg = LoadConfig(base_url=base_url, model=model, endpoint=args.endpoint, request_rate=args.request_rate,
                     burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
                     api_key=args.api_key, ignore_eos=not args.no_ignore_eos, extra_body=extra_body,
                     progress=not args.disable_tqdm)

    async def test_then_run():
        from tokenmill.bench.loadgen import make_client

        async with make_client(cfg) as client:  # one short request first: checks the setup, warms the server
            probe = await send_request(client, cfg, requests[0], 0.0, max_tokens=min(4, requests[0].output_len),
                                       extra_body=bodies[0] if bodies else None)
        if not probe.success:
            raise BenchUsageError(f"--base-url {base_url}: the test request (model {model!r}, "
                                  f"{args.endpoint} endpoint) failed: {probe.error.splitlines()[0][:300]}")
        return await run_load(cfg, requests, bodies)

    print(f"benchmark: {base_url} model {model}, {args.endpoint} endpoint, rate {args.request_rate:g} req/s, "
          f"burstiness {args.burstiness:g}, max concurrency {args.max_concurrency}", file=sys.stderr)
    spec_before = scrape(base_url, args.api_key)
    results, duration = asyncio.run(test_then_run())
    spec = delta(spec_before, scrape(base_url, args.api_key))
    metrics, output_lens = calculate_metrics(
        results, duration, lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        args.slo_ttft_ms, args.slo_tpot_ms)
    config = {"date": _now(), "label": args.label or model, "base_url": base_url, "model": model,
              "endpoint": args.endpoint, "dataset": opts.name, "dataset_options": opts.describe(),
              "num_prompts": len(requests), "request_rate": args.request_rate, "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "seed": args.seed,
              "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
              "ignore_eos": cfg.ignore_eos, "extra_body": extra_body, "lora_modules": args.lora_modules}
    per_class = class_metrics(results, output_lens, assignment, classes, duration, args.slo_ttft_ms,
                              args.slo_tpot_ms) if classes else None
    result = serve_result(config, metrics, results, output_lens, [r.output_len for r in requests],
                          per_class, assignment)
    print(format_serve(result))
    if spec is not None:
        result["spec_decode"] = spec
        print(format_spec(spec))
    if args.save_result:
        print(f"result: {save_result(result, args.save_result)}", file=sys.stderr)
    return 0


def _assign_classes(classes: list[RequestClass], n: int, seed: int) -> tuple[list[str] | None, list[dict] | None]:
    """Each request's class name and the body fields it sends (None, None for a load with no classes)."""
    from tokenmill.bench.loadgen import class_body, draw_classes

    if not classes:
        return None, None
    drawn = [classes[i] for i in draw_classes(n, [c.share for c in classes], seed)]
    counts = ", ".join(f"{c.name} {sum(1 for d in drawn if d is c)}" for c in classes)
    print(f"request classes (seed {seed}): {counts}", file=sys.stderr)
    return [c.name for c in drawn], [class_body(c) for c in drawn]


def _offline(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import run_offline
    from tokenmill.bench.report import format_offline, save_result
    from tokenmill.bench.spec_metrics import format_spec, from_stats
    from tokenmill.engine_args import EngineArgs
    from tokenmill.llm import LLM

    opts = dataset_options(args)  # checked before the model loads
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(engine_args=engine_args)
    print(llm.engine.core.startup_summary(), file=sys.stderr)
    requests = _sample(opts, llm.get_tokenizer())
    numbers = run_offline(llm, requests, progress=not args.disable_tqdm)
    model = str(args.model) if args.model else "default (SmolLM2-135M-Instruct GGUF)"
    result = {"kind": "offline", "date": _now(), "label": args.label or "tokenmill", "model": model,
              "dataset": opts.name, "dataset_options": opts.describe(), "num_prompts": len(requests),
              "request_rate": "inf",
              "engine": {k: v for k, v in dataclasses.asdict(engine_args).items() if k != "model"}, **numbers}
    print(format_offline(result))
    spec = from_stats(llm.engine.core.scheduler.spec_stats)
    if spec is not None:
        result["spec_decode"] = spec
        print(format_spec(spec))
    if args.save_result:
        print(f"result: {save_result(result, args.save_result)}", file=sys.stderr)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from tokenmill.bench.plot import plot_results
    from tokenmill.bench.report import load_result

    results = []
    for path in args.results:
        try:
            results.append(load_result(path))
        except ValueError as e:
            raise BenchUsageError(f"results: {e}") from None
    written = plot_results(results, args.out)
    if not written:
        raise BenchUsageError("results: nothing to plot (no latency samples, one result only)")
    for path in written:
        print(path)
    return 0


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
