"""LoRA adapters over HTTP (server/lora_routes.py): a request names an adapter as its `model` and gets what the
offline engine gives for that adapter; /v1/models lists adapters under their base; vLLM's load/unload routes take
the admin key, check an adapter before accepting it, and a removed adapter is a 404 again."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.models.tiny import make_tiny_adapter, make_tiny_model
from tests.server.conftest import API_KEY, start_server
from tokenmill import LLM, SamplingParams
from tokenmill.lora import LoRARequest

ADMIN = "admin-key"
PROMPT = [5, 17, 99, 3, 250, 41, 7, 11]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    model = make_tiny_model(root, vocab_size=256, num_kv_heads=2)
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return {"model": model, "qv": make_tiny_adapter(model, root / "qv", seed=1),
            "all": make_tiny_adapter(model, root / "all", r=8, targets=every, seed=2),
            "other": make_tiny_adapter(make_tiny_model(root, vocab_size=256, hidden_size=32), root / "other")}


@pytest.fixture(scope="module")
def server(dirs):
    s = start_server("--model", str(dirs["model"]), "--enable-lora", "--max-loras", "2", "--lora-modules",
                     f"qv={dirs['qv']}", "--admin-api-key", ADMIN)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def expected(dirs):
    """Offline greedy text of PROMPT per adapter (None: the base)."""
    llm = LLM(str(dirs["model"]), dtype="float32", kv_cache_memory=16 << 20, enable_lora=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    out = {}
    for i, name in enumerate((None, "qv", "all")):
        lora = LoRARequest(name, i, str(dirs[name])) if name else None
        out[name] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=lora)[0]\
            .outputs[0].text
    assert len(set(out.values())) == 3
    return out


def complete(server, model):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    return r


def test_adapters_by_name_beside_the_base(server, expected):
    models = httpx.get(server.url + "/v1/models", headers=server.headers).json()["data"]
    base = server.model
    assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("qv", base)]
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda m: (m, complete(server, m)), [base, "qv"] * 4))
    for model, r in got:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[None if model == base else "qv"]
        assert r.json()["model"] == model


def test_load_and_unload_take_the_admin_key_and_check_the_adapter(server, dirs, expected):
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    body = {"lora_name": "all", "lora_path": str(dirs["all"])}
    assert httpx.post(load, json=body, headers=server.headers).status_code == 401  # the client key: not enough
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert complete(server, "all").status_code == 404
    r = httpx.post(load, json=body, headers=admin)
    assert r.status_code == 200 and "added" in r.text
    assert complete(server, "all").json()["choices"][0]["text"] == expected["all"]
    again = httpx.post(load, json=body, headers=admin)
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    wrong = httpx.post(load, json={"lora_name": "x", "lora_path": str(dirs["other"])}, headers=admin)
    assert wrong.status_code == 400 and "another model" in wrong.json()["error"]["message"]
    missing = httpx.post(load, json={"lora_name": "y", "lora_path": "/nonexistent"}, headers=admin)
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert httpx.post(unload, json={"lora_name": "all"}, headers=admin).status_code == 200
    assert complete(server, "all").status_code == 404
    assert httpx.post(unload, json={"lora_name": "all"}, headers=admin).status_code == 404
    assert complete(server, "qv").json()["choices"][0]["text"] == expected["qv"]  # the others serve on


def test_without_enable_lora_adapters_are_refused(dirs):
    s = start_server("--model", str(dirs["model"]), "--admin-api-key", ADMIN, api_key=API_KEY)
    try:
        r = httpx.post(s.url + "/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": str(dirs["qv"])},
                       headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        s.stop()
