"""Human-readable tables for `tokenmill plan` (rich); --json bypasses all of this."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from tokenmill.planner.common import fmt_bytes, fmt_count, fmt_rate
from tokenmill.planner.hardware import GPUS, cpu_hardware
from tokenmill.planner.measure import Measurement
from tokenmill.planner.models import PRESETS, ModelShape
from tokenmill.planner.recommend import Recommendation
from tokenmill.planner.roofline import Plan

PIPE_WIDTH = 120  # rich assumes 80 columns when stdout is not a terminal; tables read better wider


def make_console() -> Console:
    """A console on the current sys.stdout (so captured output works), wide when piped."""
    console = Console(file=sys.stdout)
    return console if console.is_terminal else Console(file=sys.stdout, width=PIPE_WIDTH)


def _flops(x: float) -> str:
    return f"{x / 1e12:,.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.1f} GFLOP/s"


def _kv_table(title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    return table


def _money(x: float | None) -> str:
    return "n/a" if x is None else f"${x:,.3f}" if x < 10 else f"${x:,.2f}"


def render_plan(console: Console, model: ModelShape, p: Plan) -> None:
    """Model, memory and timing sections for one deployment."""
    t = _kv_table(f"{p.model} on {p.n_gpus} x {p.gpu_name} (tp={p.tp}, pp={p.pp}{f', cp={p.cp}' if p.cp > 1 else ''})")
    t.add_row("parameters", f"{fmt_count(p.params)} ({model.num_layers} layers{_layer_kinds(model)}, hidden "
                            f"{model.hidden_size}, {model.num_heads} heads / {model.num_kv_heads} KV heads x "
                            f"{model.head_dim})")
    if model.num_experts:
        t.add_row("active parameters", f"{fmt_count(model.active_params)} a token ({model.experts_per_token} of "
                                       f"{model.num_experts} experts in {model.moe_layer_count} layers): decode "
                                       "reads the experts its tokens use, memory holds them all")
    t.add_row("weights", f"{fmt_bytes(p.weights_bytes)} at {p.dtype} "
                         f"({fmt_bytes(p.weights_bytes_per_gpu)} per GPU)")
    only = f"; the {model.attention_layer_count} attention layers" if model.state_layers else ""
    t.add_row("KV cache per token", f"{p.kv_bytes_per_token:,} B at {p.kv_dtype} "
                                    f"({p.kv_bytes_per_token_per_gpu:,} B per GPU{only})")
    if model.state_layers:
        kinds = ", ".join(s.describe() for s in model.state_layers)
        t.add_row("recurrent state per sequence",
                  f"{p.state_bytes_per_sequence:,} B ({p.state_bytes_per_sequence_per_gpu:,} B per GPU; "
                  f"{kinds}), whatever the context")
    state = ", state included" if model.state_layers else ""
    t.add_row(f"KV per sequence ({p.context:,} tok)",
              f"{fmt_bytes(p.kv_bytes_per_sequence)} "
              f"({fmt_bytes(p.kv_bytes_per_sequence_per_gpu)} per GPU{state})")
    t.add_row("device memory", f"{fmt_bytes(p.memory_bytes_per_gpu)}, "
                               f"less {fmt_bytes(p.reserve_bytes_per_gpu)} runtime reserve, "
                               f"leaves {fmt_bytes(p.kv_budget_bytes_per_gpu)} for KV")
    fit = "[green]yes[/]" if p.fits else "[red]no[/]"
    t.add_row("fits", f"{fit}; smallest TP that fits: {p.min_tp_to_fit or 'none up to 8 (use --pp)'}")
    t.add_row("max concurrent sequences", f"{p.max_concurrent_sequences:,} of {p.context:,} tokens")
    t.add_row(f"decode step (batch {p.batch})", f"{p.decode_step_ms:,.2f} ms ({p.decode_bound}-bound)")
    t.add_row(f"prefill ({p.context:,} tokens)", f"{p.prefill_ms:,.1f} ms ({p.prefill_bound}-bound)")
    t.add_row("output tokens/s",
              f"{p.tokens_per_s:,.1f} per deployment, {p.tokens_per_s_per_gpu:,.1f} per GPU")
    t.add_row("cost", f"{_money(p.usd_per_million_tokens)} per million output tokens "
                      f"at {_money(p.usd_per_hour_per_gpu)}/GPU-hour")
    t.add_row("device peaks used", f"{fmt_rate(p.bandwidth_bytes_per_s)}, {_flops(p.peak_flops)}")
    console.print(t)
    for w in p.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def _layer_kinds(model: ModelShape) -> str:
    """A hybrid's layers by kind (': 10 short convolution, 6 attention'); nothing for attention only."""
    if not model.state_layers:
        return ""
    kinds = [f"{len(s.layers)} {s.kind}" for s in model.state_layers]
    return f": {', '.join(kinds)}, {model.attention_layer_count} attention"


def render_recommendations(console: Console, recs: list[Recommendation], tpot: float | None,
                           throughput: float | None) -> None:
    """Cheapest first."""
    target = ", ".join(s for s in (f"TPOT <= {tpot:g} ms" if tpot else "",
                                   f">= {throughput:,.0f} tokens/s" if throughput else "") if s)
    if not recs:
        console.print(f"[red]No GPU in the table meets {target or 'the target'} with TP up to 8.[/]")
        return
    t = Table(title=f"Recommendation ({target}), cheapest first", title_justify="left")
    for col in ("GPU", "TP", "replicas", "GPUs", "batch", "TPOT ms", "tokens/s", "$/hour", "$/M tokens"):
        t.add_column(col, justify="left" if col == "GPU" else "right")
    for r in recs:
        t.add_row(r.gpu, str(r.tp), str(r.replicas), str(r.n_gpus), str(r.batch), f"{r.decode_step_ms:.2f}",
                  f"{r.tokens_per_s:,.0f}", f"{r.usd_per_hour:,.2f}", _money(r.usd_per_million_tokens))
    console.print(t)


def render_measurement(console: Console, m: Measurement) -> None:
    quantized = m.engine_quantization not in (None, "none")
    fmt = f"{m.engine_quantization} ({m.engine_dtype} compute)" if quantized else m.engine_dtype
    t = _kv_table(f"Measured on this machine: {m.model}, {fmt}, batch {m.batch}")
    t.add_row("memory bandwidth (measured)", fmt_rate(m.bandwidth_bytes_per_s))
    t.add_row("fp32 matmul rate (measured)", f"{m.matmul_flops / 1e9:,.1f} GFLOP/s")
    t.add_row("decode step, measured", f"{m.measured_decode_step_ms:,.2f} ms")
    t.add_row("decode step, roofline", f"{m.predicted_decode_step_ms:,.2f} ms ({m.predicted_bound}-bound)")
    t.add_row("measured / roofline", f"{m.ratio:.2f}x")
    t.add_row("weights, in the engine", f"{fmt_bytes(m.engine_weight_bytes)} (its start-up log and /metrics)")
    t.add_row("weights, planned", f"{fmt_bytes(m.predicted_weight_bytes)} (params x bytes per parameter; the "
                                  "engine also holds norms, scales, and for int8 and fp8 a tied table twice)")
    if m.engine_kv_bytes_per_token:
        t.add_row("KV cache per token, engine / planned",
                  f"{m.engine_kv_bytes_per_token:,} B / {m.predicted_kv_bytes_per_token:,} B")
    console.print(t)


def render_list(console: Console) -> None:
    """--list: the presets and the device table."""
    t = Table(title="Model presets (--model)", title_justify="left")
    cols = ("name", "params", "layers", "hidden", "MLP", "heads", "KV heads", "head dim", "vocab", "tied")
    for col in cols:
        t.add_column(col, justify="left" if col == "name" else "right")
    for name, m in PRESETS.items():
        t.add_row(name, fmt_count(m.params), str(m.num_layers), str(m.hidden_size), str(m.intermediate_size),
                  str(m.num_heads), str(m.num_kv_heads), str(m.head_dim), str(m.vocab_size),
                  "yes" if m.tie_word_embeddings else "no")
    console.print(t)
    g = Table(title="Devices (--gpu), dense peak rates", title_justify="left")
    for col in ("key", "name", "memory", "bandwidth", "BF16 TFLOPS", "FP8 TFLOPS", "$/hour"):
        g.add_column(col, justify="left" if col in ("key", "name") else "right")
    for hw in (*GPUS.values(), cpu_hardware()):
        g.add_row(hw.key, hw.name, fmt_bytes(hw.memory_bytes), fmt_rate(hw.bandwidth_bytes_per_s),
                  f"{hw.bf16_flops / 1e12:,.1f}",
                  "-" if hw.fp8_flops is None else f"{hw.fp8_flops / 1e12:,.1f}",
                  _money(hw.usd_per_hour))
    console.print(g)
