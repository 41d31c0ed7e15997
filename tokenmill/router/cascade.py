"""LLM cascades: a request goes to the cheapest tier first and climbs to the next when the answer looks unsure.

`tokenmill router --cascade small=URL --cascade large=URL --tier-price small=0.02,0.04 --tier-price
large=0.50,1.00 --escalate-below -1.5`. Confidence is the mean logprob of the answer's tokens (asked of the tier
whatever the client asked; stripped again unless the client asked too): below `--escalate-below` the request goes
to the next tier; the last tier's answer is kept whatever it says. A streamed request is decided on its first
`--cascade-first-tokens` tokens, held back until then: sure, they and the rest stream from that tier; unsure, that
stream is closed and the next tier's streams instead. The response names the tier that answered (`tier` in the
body, an `x-tokenmill-tier` header) and what the request cost (`usage.cost_usd`, every tier it touched; a stream
cut off counts the tokens it wrote, not its prompt, which the tier had not reported yet); the
router's /metrics count answers and escalations per tier, the cost spent and what sending everything to the
last tier would have cost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    name: str
    url: str
    price_in: float = 0.0  # $ per million prompt tokens
    price_out: float = 0.0  # $ per million completion tokens

    def cost(self, usage: dict | None) -> float:
        if not usage:
            return 0.0
        return (usage.get("prompt_tokens", 0) * self.price_in + usage.get("completion_tokens", 0) * self.price_out) / 1e6


@dataclass
class CascadeConfig:
    tiers: list[Tier]
    escalate_below: float = -1.0  # mean token logprob under which a tier's answer climbs to the next tier
    first_tokens: int = 8  # a stream is judged on this many tokens


def parse_tiers(specs: list[str], prices: list[str]) -> list[Tier]:
    """`--cascade NAME=URL` (in order, cheapest first) and `--tier-price NAME=IN,OUT`; ValueError naming the flag."""
    tiers: list[tuple[str, str]] = []
    for spec in specs:
        name, eq, url = spec.partition("=")
        if not eq or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--cascade: expected NAME=http(s)://host:port, got {spec!r}")
        if any(n == name for n, _ in tiers):
            raise ValueError(f"--cascade: tier {name!r} is given twice")
        tiers.append((name, url.rstrip("/")))
    if len(tiers) < 2:
        raise ValueError("--cascade needs at least two tiers (cheapest first)")
    price: dict[str, tuple[float, float]] = {}
    for spec in prices:
        name, eq, values = spec.partition("=")
        parts = values.split(",")
        try:
            pin, pout = (float(p) for p in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            pin = pout = None
        if not eq or name not in dict(tiers) or pin is None or pin < 0 or pout < 0:
            raise ValueError(f"--tier-price: expected NAME=IN,OUT ($ per million tokens) for a --cascade tier, "
                             f"got {spec!r}")
        price[name] = (pin, pout)
    return [Tier(n, u, *price.get(n, (0.0, 0.0))) for n, u in tiers]


def ask_logprobs(body: dict, chat: bool) -> tuple[dict, bool]:
    """The body with token logprobs asked for, and whether the client had asked itself."""
    if chat:
        asked = bool(body.get("logprobs"))
        return {**body, "logprobs": True}, asked
    asked = body.get("logprobs") is not None
    return ({**body} if asked else {**body, "logprobs": 0}), asked


def token_logprobs(choice: dict, chat: bool) -> list[float]:
    """The sampled tokens' logprobs of one choice (whole or a streamed delta)."""
    lp = choice.get("logprobs") or {}
    if chat:
        return [float(t["logprob"]) for t in lp.get("content") or [] if t.get("logprob") is not None]
    return [float(v) for v in lp.get("token_logprobs") or [] if v is not None]


def mean_logprob(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def strip_logprobs(data: dict) -> dict:
    """A response or chunk without the logprobs the router asked for and the client did not."""
    for choice in data.get("choices") or []:
        if "logprobs" in choice:
            choice["logprobs"] = None
    return data


class BadEvent(ValueError):
    """A tier's answer or stream event that is not the OpenAI shape the cascade reads."""


def parse_event(payload: bytes) -> dict:
    """One SSE event's JSON object; BadEvent if it is not one."""
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):
        raise BadEvent(f"not JSON: {payload[:80]!r}") from None
    if not isinstance(data, dict):
        raise BadEvent(f"not a JSON object: {payload[:80]!r}")
    return data


def answer_logprobs(data: dict, chat: bool) -> list[list[float]]:
    """Each choice's token logprobs (of a whole answer or one streamed chunk); BadEvent if they cannot be read."""
    try:
        return [token_logprobs(c, chat) for c in data.get("choices") or []]
    except (TypeError, AttributeError, ValueError, KeyError) as e:
        raise BadEvent(f"unreadable choices: {type(e).__name__}") from None


def sse_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Whole SSE events (their data lines' payloads) and the bytes left over."""
    events = []
    while b"\n\n" in buffer:
        raw, buffer = buffer.split(b"\n\n", 1)
        data = b"\n".join(line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:"))
        if data:
            events.append(data)
    return events, buffer


def event(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()
