"""`tokenmill` command line: serve, generate, chat, bench, plan, eval, quantize."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from tokenmill.engine_args import EngineArgs, parse_bytes
from tokenmill.errors import TokenmillError
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.settings import parse_priority_range, parse_template_kwargs_flag

log = logging.getLogger("tokenmill")


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def _load_engine(args: argparse.Namespace):
    from tokenmill.llm import LLM

    llm = LLM(engine_args=EngineArgs.from_cli_args(args))
    print(llm.engine.core.startup_summary(), file=sys.stderr)
    return llm.engine


def stream(engine, prompt, params) -> str:
    """Add one request and print its text to stdout as it is made; returns the whole text."""
    rid = engine.new_request_id()
    engine.add_request(rid, prompt, params)
    printed = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                sys.stdout.write(text[printed:])
                sys.stdout.flush()
                printed = len(text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        raise
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad flags fail before the model loads
    engine = _load_engine(args)
    stream(engine, args.prompt, params)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = _load_engine(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model; an empty line or Ctrl-D ends, /reset clears the history.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        try:
            reply = stream(engine, {"prompt_token_ids": ids}, params)
        except KeyboardInterrupt:
            print("\n[interrupted]")
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})
    return 0


def add_operator_keys(g: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The keys beside the clients' --api-key, as `serve` and `router` both take them (docs/security.md)."""
    g.add_argument("--admin-api-key", default=os.environ.get("TOKENMILL_ADMIN_API_KEY"),
                   help="the operator's key for /admin/* (Bearer); without it the admin endpoints are off (404), "
                        "and the clients' --api-key never opens them (default: $TOKENMILL_ADMIN_API_KEY)")
    g.add_argument("--metrics-api-key", default=os.environ.get("TOKENMILL_METRICS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /metrics (default: $TOKENMILL_METRICS_API_KEY, "
                        "else /metrics is open)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed when ready)")
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and /ui/stats "
                        "(default: $TOKENMILL_API_KEY, else no key)")
    add_operator_keys(g)
    g.add_argument("--client-priority-range", type=parse_priority_range, default="0:",
                   help="the `priority` values a client may send, LO:HI (HI optional; a negative LO needs '=': "
                        "--client-priority-range=-5:); outside it HTTP 400. Lower runs "
                        "first under --scheduling-policy priority, so the default 0: lets a client lower its standing, "
                        "never raise it above the default")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: the --model argument, or the default model's "
                        "file name)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): NAME=PATH of a PEFT directory, or vLLM's "
                        "JSON '{\"name\": ..., \"path\": ...}'; a request picks one with its `model`. More at run "
                        "time: POST /v1/load_lora_adapter {\"lora_name\", \"lora_path\"} (admin key)")
    g.add_argument("--max-request-bytes", type=parse_bytes, default=16 << 20,
                   help="largest request body; a larger one gets HTTP 413 (default 16MiB)")
    g.add_argument("--pooling", type=str.lower, choices=["last", "mean"], default="last",
                   help="/v1/embeddings: pool the prompt's final hidden states as the last token's (the usual for "
                        "decoder embedding models) or their mean; vLLM's pooling_type LAST / MEAN")
    g.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                   help="pooling: serve an embedding model (/v1/embeddings; the generating routes answer 400), as "
                        "vLLM's --runner pooling")
    g.add_argument("--max-stored-responses", type=int, default=1000,
                   help="Responses API: responses kept for previous_response_id and GET /v1/responses/{id}, least "
                        "recently used out first (0: none kept; a request's store: false keeps its own out)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests waiting to run beyond which new ones get HTTP 429 (one request that alone needs "
                        "more, prompts x n, gets 400)")
    g.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="prompt tokens waiting to run beyond which new requests get HTTP 429 (default: the KV "
                        "cache's token capacity; one request that alone needs more gets 400)")
    g.add_argument("--slo-admission", choices=["off", "reject", "degrade"], default="off",
                   help="a request whose predicted time to first token (measured step cost, prompt tokens waiting "
                        "ahead, running batch) is past its TTFT target (slo_ttft_ms or --slo-ttft-ms): reject gets "
                        "HTTP 429 with Retry-After, degrade runs it one priority level lower; off admits it")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish on SIGTERM; then they end with HTTP 503 (or a "
                        "stream's error event)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    g.add_argument("--no-ui", action="store_true", help="no web playground and dashboard at /")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split a chat answer's <think>...</think> block into message.reasoning_content (streamed as "
                        "delta.reasoning_content), the rest staying content. deepseek_r1: the output starts inside "
                        "the block (reasoning up to </think>, all of it if none comes); qwen3: only where <think> "
                        "appears (as vLLM's parsers of those names)")
    g.add_argument("--default-chat-template-kwargs", type=parse_template_kwargs_flag, default=None,
                   metavar="JSON", help="chat template variables for every chat request, e.g. '{\"enable_thinking\": "
                                        "false}'; a request's chat_template_kwargs override them")


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.parallel.launch import torchrun_rank
    from tokenmill.parallel.worker import run_torchrun_worker
    from tokenmill.server.multi_launch import serve_many, split_models

    models = split_models(args)  # one --model: args.model is its path, as it always was
    if torchrun_rank():  # under torchrun every rank runs this command: rank 0 serves, the others are workers
        return run_torchrun_worker(EngineArgs.from_cli_args(args).create_engine_config())
    if len(models) > 1:
        return serve_many(args, models)
    from tokenmill.server.launch import serve

    return serve(args)


def cmd_router(args: argparse.Namespace) -> int:
    from tokenmill.router.app import CascadeConfig, run_router
    from tokenmill.router.cascade import parse_tiers
    from tokenmill.router.replicas import ReplicaPool

    cascade = None
    if bool(args.prefill) != bool(args.decode):
        print("error: --prefill and --decode go together: at least one prefill and one decode instance",
              file=sys.stderr)
        return 2
    if args.prefill:
        if args.backend or args.cascade:
            print("error: --prefill/--decode do not mix with --backend or --cascade", file=sys.stderr)
            return 2
        args.backend = args.decode
    if args.cascade:
        if args.backend:
            print("error: --cascade and --backend do not mix: a cascade's tiers are its replicas", file=sys.stderr)
            return 2
        try:
            cascade = CascadeConfig(parse_tiers(args.cascade, args.tier_price), args.escalate_below,
                                    args.cascade_first_tokens)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif not args.backend:
        print("error: --backend URL is required (repeat it for each replica), or --cascade NAME=URL tiers",
              file=sys.stderr)
        return 2
    try:
        for url in args.backend + args.prefill:
            ReplicaPool.normalize(url)
    except ValueError as e:
        print(f"error: {'--decode' if args.prefill else '--backend'}/--prefill: {e}", file=sys.stderr)
        return 2
    return run_router(args.backend, args.policy, args.host, args.port, args.api_key, args.backend_api_key,
                      args.health_interval, args.max_attempts, cascade, args.prefill,
                      admin_api_key=args.admin_api_key, metrics_api_key=args.metrics_api_key,
                      max_request_bytes=args.max_request_bytes, max_connections=args.max_connections)


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenmill.parallel.launch import run_node

    config = EngineArgs.from_cli_args(args).create_engine_config()
    if config.nnodes < 2 or config.node_rank < 1:
        print("error: `tokenmill worker` runs the ranks of node 1 and later: give --nnodes N (N >= 2) and "
              "--node-rank K (K >= 1), --master-addr and --master-port as node 0's `tokenmill serve` has them",
              file=sys.stderr)
        return 2
    return run_node(config)


def cmd_plan(args: argparse.Namespace) -> int:
    from tokenmill.plan import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: an LLM serving engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    # conflict_handler: add_pool_args replaces the engine group's --model with a repeatable one
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, models, metrics)",
                       conflict_handler="resolve")
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    from tokenmill.server.multi_launch import add_pool_args

    add_pool_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from one prompt, streaming to stdout")
    p.add_argument("prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with history, through the model's chat template")
    p.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("worker", help="the parallel ranks of another host (--nnodes, --node-rank, --master-addr, "
                                      "--master-port; the same engine flags as node 0's serve)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_worker)

    from tokenmill.router.policies import POLICIES

    p = sub.add_parser("router", help="the OpenAI API in front of many replicas: cache-aware, failing over")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's root URL (repeat for each), e.g. http://10.0.0.2:8000")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance (--kv-transfer-config kv_producer; repeat for each): with --decode, "
                        "each request's prompt runs here and its KV is shipped to the decode instance")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode instance (--kv-transfer-config kv_consumer; repeat for each): takes the KV and "
                        "streams the answer")
    p.add_argument("--policy", choices=POLICIES, default="prefix",
                   help="prefix: the replica sent the longest prefix of the prompt (least load when imbalanced); "
                        "least_load; round_robin (default prefix)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0: a free port (the ready line says which)")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="the clients' key: require Authorization: Bearer KEY on /v1/* (default $TOKENMILL_API_KEY)")
    add_operator_keys(p)
    p.add_argument("--backend-api-key", default=os.environ.get("TOKENMILL_BACKEND_API_KEY"),
                   help="the key the router sends to the replicas (default $TOKENMILL_BACKEND_API_KEY)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=16 << 20,
                   help="largest request body, on every route; a larger one gets HTTP 413 as soon as it passes "
                        "the limit (default 16MiB)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="client requests served at once; past it HTTP 429 with Retry-After (default 1024; also "
                        "bounds the router's connections to the replicas)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="replicas a request may be tried on before it fails (only before its response began)")
    p.add_argument("--cascade", action="append", default=[], metavar="NAME=URL",
                   help="a cascade tier, cheapest first (repeat: at least two); replaces --backend")
    p.add_argument("--tier-price", action="append", default=[], metavar="NAME=IN,OUT",
                   help="a tier's $ per million prompt and completion tokens, for usage.cost_usd and /metrics")
    p.add_argument("--escalate-below", type=float, default=-1.0,
                   help="a tier's answer whose mean token logprob is below this goes to the next tier")
    p.add_argument("--cascade-first-tokens", type=int, default=8,
                   help="a stream is judged on this many tokens, held back until then")
    p.set_defaults(func=cmd_router)

    from tokenmill.bench.cli_args import add_bench_parser

    add_bench_parser(sub)

    from tokenmill.plan import add_plan_arguments

    p = sub.add_parser("plan", help="capacity planner: memory, KV bytes per token, roofline latency, cost")
    add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    from tokenmill.eval import add_eval_parser

    add_eval_parser(sub)

    from tokenmill.quantize import add_quantize_parser

    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except TokenmillError as e:
        message, param = str(e), getattr(e, "param", None)
        if param and message.startswith(param):  # name the flag, not the field
            message = "--" + param.replace("_", "-") + message[len(param):]
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
