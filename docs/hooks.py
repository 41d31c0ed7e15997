"""mkdocs hooks: the pages and plots made from the code and the saved numbers, at build time, so they cannot drift.

- reference/flags.md: every command's flags, read from `tokenmill.cli.build_parser()` and the `EngineArgs` fields;
- reference/metrics.md: every Prometheus series, read from the server's and the router's metric registries;
- performance/plots/*.png: one chart per entry of `charts` in docs/performance/data/*.json (matplotlib, Agg).

Nothing is written into the source tree: the files are handed to mkdocs as generated files. tests/test_docs.py
imports this module to check the flags page against the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "performance" / "data"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Defaults some flags read from the environment; the page must not show the building machine's keys.
_ENV_DEFAULTS = ("TOKENMILL_API_KEY", "TOKENMILL_ADMIN_API_KEY", "TOKENMILL_METRICS_API_KEY",
                 "TOKENMILL_BACKEND_API_KEY", "TOKENMILL_KV_SECRET", "OPENAI_API_KEY")
ENGINE_GROUP = "engine"


# ---- the flags page ----------------------------------------------------------------------------------------------

@contextmanager
def _clean_environment():
    saved = {k: os.environ.pop(k) for k in _ENV_DEFAULTS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    from tokenmill.cli import build_parser as cli_parser

    with _clean_environment():
        return cli_parser()


def commands(parser: argparse.ArgumentParser, prefix: str = "tokenmill") -> list[tuple[str, argparse.ArgumentParser,
                                                                                      str]]:
    """(name, parser, help) of every command that takes flags, depth first: `tokenmill bench serve`, ..."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                full = f"{prefix} {name}"
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if not nested:
                    out.append((full, sub, helps.get(name, "")))
                out.extend(commands(sub, full))
    return out


def _md(text: str) -> str:
    """Help text as a table cell: no pipes, no HTML, no emphasis, one line."""
    text = str(text).replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(text.split())


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


def _default(action: argparse.Action) -> str:
    value = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    if value is None or value == [] or value is argparse.SUPPRESS:
        return "none"
    if isinstance(value, int) and not isinstance(value, bool) and getattr(action.type, "__name__", "") == "parse_bytes":
        return f"`{_bytes(value)}`"
    return f"`{value}`"


def _flags(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) if action.option_strings else f"`{action.dest}`"
    if isinstance(action, argparse._AppendAction):
        names += " (repeatable)"
    elif action.nargs in ("+", "*"):
        names += " (one or more)"
    return names


def _meaning(action: argparse.Action) -> str:
    text = action.help or ""
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text = f"one of {', '.join(f'`{c}`' for c in action.choices)}. {text}" if text else \
            f"one of {', '.join(f'`{c}`' for c in action.choices)}"
    return _md(text)


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for a in actions:
        rows.append(f"| {_flags(a)} | {_default(a)} | {_meaning(a)} |")
    return rows


def _engine_table() -> list[str]:
    from tokenmill.engine_args import EngineArgs

    rows = ["| flag | `LLM(...)` keyword | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            names = f"`{flag}`, `--no-{flag[2:]}`"
            default = "on" if f.default else "off"
        else:
            names = f"`{flag}`"
            default = "none" if f.default is None else f"`{f.default}`"
        text = meta["help"]
        if meta["choices"]:
            text = f"one of {', '.join(f'`{c}`' for c in meta['choices'])}. {text}"
        rows.append(f"| {names} | `{f.name}` | {default} | {_md(text)} |")
    return rows


def _visible(actions: list[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            and not isinstance(a, argparse._SubParsersAction)]


def flags_page() -> str:
    parser = build_parser()
    lines = [
        "# Command-line flags",
        "",
        "Every flag of every `tokenmill` command, with its default and meaning. This page is generated when the site",
        "is built, from the parser the `tokenmill` command itself uses (`tokenmill.cli.build_parser()`) and from the",
        "`EngineArgs` dataclass, so it always matches the code; `tokenmill COMMAND --help` prints the same.",
        "",
        "Global: `-v`, `--verbose` (`tokenmill -v serve ...`) logs at INFO level. `python -m tokenmill ...` is the",
        "same command.",
        "",
        "## Engine flags",
        "",
        "`tokenmill serve`, `generate`, `chat`, `worker`, `bench offline` and `eval ppl` take these. Each is also a",
        "keyword of `LLM(...)` in Python (second column): `LLM(model=\"x.gguf\", kv_cache_memory=2 << 30)`. Sizes such",
        "as `--kv-cache-memory` take `2GiB`, `500M` or a byte count. What they do in practice:",
        "[Serving](../serving/index.md), [Scheduling and latency targets](../serving/scheduling.md),",
        "[Quantization](../models/quantization.md), [Parallelism](../deployment/parallelism.md).",
        "",
        *_engine_table(),
        "",
    ]
    for name, sub, help_text in commands(parser):
        lines += [f"## {name}", ""]
        if help_text:
            lines += [_md(help_text[0].upper() + help_text[1:]) + ".", ""]
        positionals = [a for a in _visible(sub._actions) if not a.option_strings]
        if positionals:
            lines += ["Arguments: " + "; ".join(f"`{a.dest}`" + (f": {_md(a.help)}" if a.help else "")
                                                  for a in positionals) + ".", ""]
        for group in sub._action_groups:
            actions = [a for a in _visible(group._group_actions) if a.option_strings]
            if group.title == ENGINE_GROUP:
                lines += ["The [engine flags](#engine-flags)" + (" (its `--model` is the repeatable one below)."
                                                                 if name == "tokenmill serve" else "."), ""]
                continue
            if not actions:
                continue
            if group.title not in ("options", "optional arguments"):
                lines += [f"**{_md(group.title)}**", ""]
            lines += [*_table(actions), ""]
    return "\n".join(lines) + "\n"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands, help aside."""
    found = set()
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                found |= option_strings(sub)
        elif not isinstance(a, argparse._HelpAction):
            found.update(a.option_strings)
    return found


def missing_flags(page: str, parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of `parser` (and its subcommands) that `page` does not name as `--flag`."""
    return sorted(s for s in option_strings(parser) if f"`{s}`" not in page)


# ---- the metrics page --------------------------------------------------------------------------------------------

def _families(registry, wrappers: dict[str, tuple[str, ...]]) -> list[str]:
    rows = []
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = wrappers.get(family.name)
        if labels is None:
            labels = tuple(k for s in family.samples[:1] for k in s.labels)
        label_text = ", ".join(f"`{k}`" for k in labels if k != "model_name") or ""
        rows.append(f"| `{name}` | {family.type} | {label_text} | {_md(family.documentation)} |")
    return rows


def _wrapper_labels(obj) -> dict[str, tuple[str, ...]]:
    from prometheus_client.metrics import MetricWrapperBase

    return {m._name: tuple(m._labelnames) for m in vars(obj).values() if isinstance(m, MetricWrapperBase)}


def metrics_page() -> str:
    from tokenmill.router.metrics import RouterMetrics
    from tokenmill.router.replicas import ReplicaPool
    from tokenmill.server.metrics import ServerMetrics

    server = ServerMetrics("MODEL")
    pool = ReplicaPool(["http://replica:8000"])
    router = RouterMetrics(pool, ReplicaPool(["http://prefill:8000"]))
    head = ["| series | type | labels | meaning |", "|---|---|---|---|"]
    lines = [
        "# Metrics",
        "",
        "What `GET /metrics` exposes, in Prometheus' text format. Generated when the site is built from the metric",
        "registries themselves (`tokenmill.server.metrics.ServerMetrics`, `tokenmill.router.metrics.RouterMetrics`),",
        "so the list cannot fall behind the code. Histograms add `_bucket`, `_sum` and `_count` series.",
        "",
        "## tokenmill serve",
        "",
        "Every series carries a `model_name` label (the served name). With `--metrics-api-key` the route needs",
        "`Authorization: Bearer KEY`; without it `/metrics` is open, as Prometheus scrapers expect. A server with",
        "several `--model`s renders every loaded model's series together and adds the pool's own:",
        "`tokenmill_model_state`, `tokenmill_model_requests_in_flight`, `tokenmill_model_memory_bytes`,",
        "`tokenmill_model_loads_total`, `tokenmill_model_unloads_total{reason}`, `tokenmill_model_load_seconds` and",
        "`tokenmill_pool_requests_rejected_total{status}` ([Several models](../serving/several-models.md)).",
        "",
        *head, *_families(server.registry, _wrapper_labels(server)),
        "",
        "## tokenmill router",
        "",
        "The `_prefill_` pool series exist only with `--prefill`/`--decode` "
        "([Disaggregated prefill and decode](../deployment/disaggregation.md)).",
        "",
        *head, *_families(router.registry, _wrapper_labels(router)),
        "",
    ]
    return "\n".join(lines)


# ---- the performance plots ---------------------------------------------------------------------------------------

def _value(v):
    """A number; the median of a list of numbers (the runs of one measurement); or {"from": a JSON file under the
    repository (benchmarks/results/...), "path": [keys]}: the number or runs stored there."""
    if isinstance(v, dict):
        data = json.loads((ROOT / v["from"]).read_text())
        for key in v["path"]:
            data = data[key]
        return _value(data)
    return statistics.median(v) if isinstance(v, list) else v


def render_chart(chart: dict, cpu: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
    series = chart["series"]
    kind = chart.get("kind", "bar")
    if kind == "line":
        for s in series:
            ax.plot(s.get("x", chart.get("x")), [_value(v) for v in s["values"]], marker="o", label=s["label"])
        ax.set_xlabel(chart.get("xlabel", ""))
    else:
        cats = chart["categories"]
        width = 0.8 / len(series)
        for i, s in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cats))]
            values = [_value(v) for v in s["values"]]
            bars = ax.bar(xs, [0 if v is None else v for v in values], width, label=s["label"])
            for bar, v in zip(bars, values):
                if v is not None:
                    ax.annotate(chart.get("fmt", "{:g}").format(v), (bar.get_x() + bar.get_width() / 2,
                                                                     bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cats)), cats, fontsize=8)
    if chart.get("log"):
        ax.set_yscale("log")
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, top * (6 if chart.get("log") else 1.3))  # room for the legend above the bars
    if "hline" in chart:
        ax.axhline(chart["hline"], color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylabel(chart.get("ylabel", ""))
    ax.set_title(chart["title"], fontsize=10)
    if len(series) > 1 or kind == "line":
        ax.legend(fontsize=8, loc="upper center", ncol=min(3, len(series)), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.text(0.01, 0.01, f"CPU: {chart.get('cpu', cpu)}", fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def performance_data() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}


def plots() -> dict[str, bytes]:
    """performance/plots/<file> -> PNG bytes, for every chart of every data file."""
    out = {}
    for data in performance_data().values():
        for chart in data.get("charts", []):
            out[chart["file"]] = render_chart(chart, data["cpu"])
    return out


# ---- mkdocs events -----------------------------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/flags.md", content=flags_page()))
    files.append(File.generated(config, "reference/metrics.md", content=metrics_page()))
    for name, png in plots().items():
        files.append(File.generated(config, f"performance/plots/{name}", content=png))
    return files
