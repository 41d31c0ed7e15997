"""LLM cascades in the router (router/cascade.py): a sure answer stays on the cheap tier, an unsure one climbs,
streams are judged on their first tokens, and the cost adds up exactly. Two tiny models of known confidence: a
random one (its next-token distribution is nearly flat: mean logprob about -10) and the same with its final norm
scaled up (its logits so peaked that every token it picks has logprob about 0)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.router.test_router import H, start_router, stop
from tests.server.conftest import start_server
from tokenmill.router.cascade import parse_tiers, sse_events, token_logprobs

PRICES = {"sure": (0.1, 0.2), "unsure": (1.0, 3.0)}  # $ per million prompt, completion tokens


def sure_model(path: Path) -> Path:
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1000.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_parse_tiers_checks_names_urls_and_prices():
    tiers = parse_tiers(["small=http://a:1", "large=http://b:2/"], ["small=0.1,0.2"])
    assert [(t.name, t.url, t.price_in, t.price_out) for t in tiers] == [("small", "http://a:1", 0.1, 0.2),
                                                                         ("large", "http://b:2", 0.0, 0.0)]
    assert tiers[0].cost({"prompt_tokens": 1_000_000, "completion_tokens": 500_000}) == pytest.approx(0.2)
    for specs, prices, what in ((["a=http://x"], [], "at least two"), (["a=x", "b=http://y"], [], "NAME=http"),
                                (["a=http://x", "a=http://y"], [], "twice"),
                                (["a=http://x", "b=http://y"], ["c=1,2"], "--tier-price"),
                                (["a=http://x", "b=http://y"], ["a=1"], "--tier-price"),
                                (["a=http://x", "b=http://y"], ["a=-1,2"], "--tier-price")):
        with pytest.raises(ValueError, match=what):
            parse_tiers(specs, prices)


def test_sse_events_and_logprobs_are_read_from_both_endpoints():
    events, rest = sse_events(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"par')
    assert events == [b'{"a": 1}', b"[DONE]"] and rest == b'data: {"par'
    assert token_logprobs({"logprobs": {"token_logprobs": [-0.5, None, -1.5]}}, chat=False) == [-0.5, -1.5]
    assert token_logprobs({"logprobs": {"content": [{"logprob": -2.0}]}}, chat=True) == [-2.0]
    assert token_logprobs({"logprobs": None}, chat=True) == []


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    unsure = make_tiny_model(tmp_path_factory.mktemp("unsure"), num_heads=4, num_kv_heads=2)
    sure = sure_model(make_tiny_model(tmp_path_factory.mktemp("sure"), num_heads=4, num_kv_heads=2, seed=1))
    flags = ["--kv-cache-memory", "32MiB", "--threads", "1"]
    with ThreadPoolExecutor(2) as pool:
        servers = dict(zip(("sure", "unsure"), pool.map(lambda m: start_server("--model", str(m), *flags,
                                                                               api_key=None), (sure, unsure))))
    yield servers
    for s in servers.values():
        s.stop()


def router_for(tiers, order: list[str]):
    args = [a for name in order for a in ("--cascade", f"{name}={tiers[name].url}")]
    args += [a for name in order for a in ("--tier-price", f"{name}={PRICES[name][0]},{PRICES[name][1]}")]
    return start_router([], *args, "--escalate-below", "-1.0", "--cascade-first-tokens", "4")


def cost(name: str, usage: dict) -> float:
    pin, pout = PRICES[name]
    return (usage["prompt_tokens"] * pin + usage["completion_tokens"] * pout) / 1e6


BODY = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.mark.slow
def test_a_sure_answer_stays_on_the_cheap_tier(tiers):
    proc, url = router_for(tiers, ["sure", "unsure"])
    try:
        r = httpx.post(url + "/v1/completions", json=BODY, headers=H, timeout=60)
        out = r.json()
        assert r.status_code == 200 and out["tier"] == "sure" and r.headers["x-tokenmill-tier"] == "sure"
        assert out["choices"][0]["logprobs"] is None  # asked by the router, not the client: stripped
        assert out["usage"]["cost_usd"] == pytest.approx(cost("sure", out["usage"]))
        metrics = httpx.get(url + "/metrics").text
        assert 'tokenmill_router_cascade_answers_total{tier="sure"} 1.0' in metrics
    finally:
        stop(proc)


@pytest.mark.slow
def test_an_unsure_answer_climbs_and_the_costs_add_up(tiers):
    proc, url = router_for(tiers, ["unsure", "sure"])
    try:
        r = httpx.post(url + "/v1/completions", json={**BODY, "logprobs": 1}, headers=H, timeout=60)
        out = r.json()
        assert out["tier"] == "sure" and out["choices"][0]["logprobs"] is not None  # the client asked for them
        usage = out["usage"]  # both tiers read the same prompt (one tokenizer) and wrote max_tokens tokens
        assert usage["cost_usd"] == pytest.approx(cost("unsure", usage) + cost("sure", usage))
        direct = httpx.post(tiers["sure"].url + "/v1/completions", json=BODY, timeout=60).json()
        assert out["choices"][0]["text"] == direct["choices"][0]["text"]
        chat = httpx.post(url + "/v1/chat/completions", headers=H, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0})
        assert chat.json()["tier"] == "sure" and chat.json()["choices"][0]["logprobs"] is None
        metrics = httpx.get(url + "/metrics").text
        assert 'tokenmill_router_cascade_escalations_total{tier="unsure"} 2.0' in metrics
    finally:
        stop(proc)


@pytest.mark.slow
def test_streams_are_judged_on_their_first_tokens(tiers):
    for order, expect in ((["unsure", "sure"], "sure"), (["sure", "unsure"], "sure")):
        proc, url = router_for(tiers, order)
        try:
            body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=H, timeout=60) as r:
                assert r.headers["x-tokenmill-tier"] == expect
                events, _ = sse_events(r.read())
            chunks = [json.loads(e) for e in events if e != b"[DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            direct = httpx.post(tiers[expect].url + "/v1/completions", json=BODY, timeout=60).json()
            assert text == direct["choices"][0]["text"] and events[-1] == b"[DONE]"
            assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
            usage = chunks[-1]["usage"]
            assert chunks[-1]["tier"] == expect and usage["cost_usd"] >= cost(expect, usage)
        finally:
            stop(proc)


@pytest.mark.slow
def test_a_hung_tier_is_skipped_once_its_health_checks_fail(tiers):
    """A first tier that accepts and never answers: taken out by its health checks, the request climbs."""
    import socket
    import threading

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    threading.Thread(target=lambda: [hung.accept() for _ in range(16)], daemon=True).start()
    proc, url = start_router([], "--cascade", f"hung=http://127.0.0.1:{hung.getsockname()[1]}",
                             "--cascade", f"sure={tiers['sure'].url}")
    try:
        r = httpx.post(url + "/v1/completions", json=BODY, headers=H, timeout=60)
        assert r.status_code == 200 and r.json()["tier"] == "sure"
    finally:
        stop(proc)
        hung.close()
