"""ServerSettings: what the HTTP layer needs to know beyond the engine (names, keys, body limit, what clients may
ask for)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequest


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None  # the clients' key (--api-key)
    admin_api_key: str | None = None  # /admin/* (--admin-api-key); without it they are off
    metrics_api_key: str | None = None  # /metrics (--metrics-api-key); without it open
    client_priority_range: tuple[int, int | None] = (0, None)  # --client-priority-range LO:HI (HI None: no bound)
    max_request_bytes: int = 16 << 20  # as --max-request-bytes' default
    ui: bool = True  # the playground and dashboard at / (--no-ui: off)
    created: int = field(default_factory=lambda: int(time.time()))

    def check_priority(self, priority: int) -> None:
        """A client's `priority` within --client-priority-range, or a 400 naming the flag: under --scheduling-policy
        priority a lower value preempts, so by default a client may lower its standing but never raise it."""
        lo, hi = self.client_priority_range
        if priority < lo or (hi is not None and priority > hi):
            raise InvalidRequest(f"priority {priority} is outside what this server lets clients ask for "
                                 f"(--client-priority-range {format_priority_range(self.client_priority_range)})",
                                 param="priority")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


def parse_priority_range(text: str) -> tuple[int, int | None]:
    """'LO:HI' with HI optional ('0:' = zero or more): the priorities a client may choose."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi) if hi.strip() else None)
    except ValueError:
        bounds = None
    if not sep or bounds is None or (bounds[1] is not None and bounds[1] < bounds[0]):
        raise argparse.ArgumentTypeError(f"--client-priority-range {text!r}: expected LO:HI with LO <= HI, HI optional "
                          "(e.g. 0: or -10:10)")
    return bounds


def format_priority_range(bounds: tuple[int, int | None]) -> str:
    return f"{bounds[0]}:{'' if bounds[1] is None else bounds[1]}"
