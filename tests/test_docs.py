"""The documentation: the site builds with --strict, the generated flags page names every flag the command line
has, the README stays short and its links resolve, the Kubernetes manifest's commands parse, every performance page
has its CPU, command and plots, and no file narrates how the code was written."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.engine_args import EngineArgs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("tokenmill_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _hooks()


@pytest.fixture(scope="module")
def flags_page() -> str:
    return hooks.flags_page()


# ---- the flags page ------------------------------------------------------------------------------------------------

def test_flags_page_names_every_engine_arg_with_its_llm_keyword(flags_page):
    for f in __import__("dataclasses").fields(EngineArgs):
        flag = EngineArgs.flag_of(f.name)
        assert f"`{flag}`" in flags_page, flag
        assert f"`{f.name}`" in flags_page, f.name  # the LLM(...) keyword column
        if isinstance(f.default, bool):
            assert f"`--no-{flag[2:]}`" in flags_page, flag


def test_flags_page_names_every_option_of_every_command(flags_page):
    parser = hooks.build_parser()
    assert hooks.missing_flags(flags_page, parser) == []
    serve = next(sub for name, sub, _ in hooks.commands(parser) if name == "tokenmill serve")
    assert len(hooks.option_strings(serve)) > 60  # the engine, server and model-pool groups are all there
    for command in ("serve", "generate", "chat", "worker", "router", "bench serve", "bench offline", "bench plot",
                    "plan", "eval ppl", "quantize"):
        assert f"## tokenmill {command}\n" in flags_page, command


def test_a_flag_the_page_lacks_is_reported_missing(flags_page):
    parser = hooks.build_parser()
    sub = next(sub for name, sub, _ in hooks.commands(parser) if name == "tokenmill serve")
    sub.add_argument("--no-such-flag-for-the-docs-test", type=int)
    assert hooks.missing_flags(flags_page, parser) == ["--no-such-flag-for-the-docs-test"]


def test_flags_page_does_not_show_the_building_machines_keys(monkeypatch):
    monkeypatch.setenv("TOKENMILL_API_KEY", "sk-secret-of-the-build-machine")
    monkeypatch.setenv("TOKENMILL_ADMIN_API_KEY", "sk-admin-secret-of-the-build-machine")
    page = hooks.flags_page()
    assert "secret-of-the-build-machine" not in page
    assert os.environ["TOKENMILL_API_KEY"] == "sk-secret-of-the-build-machine"  # put back after the build


def test_metrics_page_lists_the_servers_and_the_routers_series():
    page = hooks.metrics_page()
    for name in ("tokenmill_requests_total", "tokenmill_time_to_first_token_seconds", "tokenmill_leaked_blocks",
                 "tokenmill_prefix_cache_hits_total", "tokenmill_router_requests_total",
                 "tokenmill_router_backend_healthy"):
        assert f"`{name}`" in page, name


# ---- the site ------------------------------------------------------------------------------------------------------

def test_the_site_builds_strict_and_search_finds_a_gguf_behind_the_router(tmp_path):
    for module in ("mkdocs", "material"):  # the docs extra `make setup` installs: missing is a failure, not a skip
        importlib.import_module(module)
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "reference" / "flags" / "index.html").exists()
    for data in hooks.performance_data().values():
        for chart in data["charts"]:
            assert (site / "performance" / "plots" / chart["file"]).stat().st_size > 5000, chart["file"]
    index = json.loads((site / "search" / "search_index.json").read_text())
    hits = [d["location"] for d in index["docs"]
            if "gguf" in (d["title"] + d["text"]).lower() and "router" in (d["title"] + d["text"]).lower()
            and "tokenmill router" in d["text"] and "--model" in d["text"]]
    assert any(loc.startswith("serving/router/") for loc in hits), hits


# ---- the README and BENCHMARKS.md -----------------------------------------------------------------------------------

def test_readme_is_at_most_200_lines_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make serve" in text and "make test" in text
    _check_links(ROOT / "README.md")


def test_benchmarks_md_is_a_short_index_whose_links_resolve():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 120
    _check_links(ROOT / "BENCHMARKS.md")
    for data in hooks.performance_data().values():
        assert f"docs/performance/{data['page']}" in text, data["page"]


def _check_links(md: Path) -> None:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
        if "://" in target:
            continue
        assert (md.parent / target).exists(), f"{md.name}: {target}"


# ---- the performance pages -----------------------------------------------------------------------------------------

def test_each_performance_topic_has_its_cpu_command_and_plots_on_its_page():
    data = hooks.performance_data()
    assert len(data) >= 14
    for name, topic in data.items():
        assert topic["cpu"] and topic["command"] and topic["date"] and topic["charts"], name
        page = (DOCS / "performance" / topic["page"]).read_text()
        assert "**CPU**" in page or "CPU:" in page, topic["page"]
        for chart in topic["charts"]:
            assert f"(plots/{chart['file']})" in page, (topic["page"], chart["file"])
            for series in chart["series"]:
                values = [hooks._value(v) for v in series["values"] if v is not None]
                assert values and all(isinstance(v, (int, float)) for v in values), (name, series["label"])


def test_a_chart_is_drawn_from_its_numbers():
    chart = {"file": "x.png", "title": "t", "categories": ["a", "b"],
             "series": [{"label": "s", "values": [[1.0, 3.0, 2.0], {"from": "benchmarks/results/embeddings.json",
                                                                    "path": ["median", "tokenmill", "1"]}]}]}
    assert hooks._value(chart["series"][0]["values"][0]) == 2.0
    assert 15 < hooks._value(chart["series"][0]["values"][1]) < 16
    assert hooks.render_chart(chart, "a CPU").startswith(b"\x89PNG")


# ---- the Kubernetes manifest ---------------------------------------------------------------------------------------

def test_kubernetes_manifest_commands_parse_and_the_router_names_each_replica():
    import yaml  # PyYAML, which mkdocs depends on
    text = (DOCS / "deployment" / "kubernetes.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(block)}
    secret = docs[("Secret", "tokenmill-keys")]
    replicas = docs[("StatefulSet", "tokenmill")]
    router = docs[("Deployment", "tokenmill-router")]
    parser = hooks.build_parser()
    serve = replicas["spec"]["template"]["spec"]["containers"][0]
    route = router["spec"]["template"]["spec"]["containers"][0]
    serve_args, route_args = parser.parse_args(serve["args"]), parser.parse_args(route["args"])
    assert serve_args.command == "serve" and route_args.command == "router"
    service = replicas["spec"]["serviceName"]
    assert docs[("Service", service)]["spec"]["clusterIP"] == "None"
    wanted = [f"http://{replicas['metadata']['name']}-{i}.{service}:{serve_args.port}"
              for i in range(replicas["spec"]["replicas"])]
    assert route_args.backend == wanted
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for c in (serve, route) for e in c["env"]}
    assert all(ref["name"] == "tokenmill-keys" and ref["key"] in secret["stringData"] for ref in keys.values())
    assert {"TOKENMILL_API_KEY", "TOKENMILL_BACKEND_API_KEY", "TOKENMILL_ADMIN_API_KEY"} <= set(keys)
    assert serve["env"][0]["valueFrom"]["secretKeyRef"]["key"] == next(
        e["valueFrom"]["secretKeyRef"]["key"] for e in route["env"] if e["name"] == "TOKENMILL_BACKEND_API_KEY")


# ---- no file narrates how the code was written -----------------------------------------------------------------------

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|"
             r"(?:twenty|thirty)-\w+|\d+(?:st|nd|rd|th)")
NARRATION = re.compile(rf"\b(?:{_ORDINALS})[\s-]+session\b|\b(?:this|last|next|previous|earlier|that|these)\s+"
                       r"sessions?\b(?!\s+of\s+(?:its|their)\s+own)", re.IGNORECASE)
_SKIP_DIRS = {".git", ".venv", "site", "__pycache__", ".pytest_cache", ".hypothesis", "results", "node_modules"}


def _narration_hits() -> list[str]:
    hits = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            if not name.endswith((".md", ".py")):
                continue
            path = Path(dirpath) / name
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if NARRATION.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    return hits


def test_no_markdown_or_python_file_narrates_work_sessions():
    assert _narration_hits() == []


def test_the_narration_check_catches_what_it_is_for():
    ordinal = "Twenty" + "-second"
    assert NARRATION.search(f"## {ordinal} session (issue 14): multi-step decode")
    assert NARRATION.search("measured in the 12" + "th session")
    assert NARRATION.search("as the last " + "session found")
    assert not NARRATION.search("the jobs ran in a session of their own (start_new_session)")
    assert not NARRATION.search("pytest_collection_finish(session)")
