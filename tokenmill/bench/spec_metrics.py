"""Speculative-decoding acceptance for a benchmark run: from the engine in-process (offline), or as the increase of
a server's Prometheus counters over the run (tokenmill's `tokenmill_spec_decode_*`, vLLM's `vllm:spec_decode_*`)."""

from __future__ import annotations

from typing import Any

import httpx

_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def summary(num_drafts: int, num_draft_tokens: int, num_accepted: int, accepted_per_pos: list[int]) -> dict[str, Any]:
    """The numbers vLLM's benchmark prints: acceptance rate, mean accepted length, acceptance by position."""
    return {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted,
            "acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
            "mean_accepted_length": 1 + num_accepted / num_drafts if num_drafts else 0.0,
            "accepted_per_position": [a / num_drafts if num_drafts else 0.0 for a in accepted_per_pos]}


def from_stats(stats: Any) -> dict[str, Any] | None:
    """From the engine's SpecDecodeStats (None: speculation off)."""
    if stats is None:
        return None
    return summary(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_pos))


def scrape(base_url: str, api_key: str | None = None) -> dict[str, Any] | None:
    """The server's speculation counters now: {name: total, "per_pos": [...]}; None where it exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:  # no metrics there (llama-server without --metrics answers 501)
        return None
    try:
        families = list(text_string_to_metric_families(response.text))
    except ValueError:  # not Prometheus text
        return None
    found: dict[str, Any] = {"per_pos": {}}
    for family in families:
        for sample in family.samples:
            name = sample.name.replace("vllm:", "vllm_")
            for prefix in ("tokenmill_spec_decode_", "vllm_spec_decode_"):
                if not name.startswith(prefix) or not name.endswith("_total"):
                    continue
                key = name[len(prefix):-len("_total")]
                if key == "num_accepted_tokens_per_pos":
                    pos = int(sample.labels.get("position", 0))
                    found["per_pos"][pos] = found["per_pos"].get(pos, 0) + sample.value
                elif key in _COUNTERS:
                    found[key] = found.get(key, 0) + sample.value
    return found if any(k in found for k in _COUNTERS) else None


def delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a run added to the counters, summarised."""
    if after is None:
        return None
    before = before or {"per_pos": {}}
    counts = [int(after.get(k, 0) - before.get(k, 0)) for k in _COUNTERS]
    positions = sorted(after["per_pos"])
    per_pos = [int(after["per_pos"][p] - before["per_pos"].get(p, 0)) for p in positions]
    return summary(*counts, per_pos) if counts[0] > 0 else None


def format_spec(spec: dict[str, Any]) -> str:
    by_pos = ", ".join(f"{r:.2f}" for r in spec["accepted_per_position"])
    return (f"Speculative decoding: {spec['num_drafts']} drafts, {spec['num_draft_tokens']} draft tokens, "
            f"{spec['num_accepted_tokens']} accepted; acceptance rate {spec['acceptance_rate']:.1%}, mean accepted "
            f"length {spec['mean_accepted_length']:.2f}, acceptance by position [{by_pos}]")
