"""ServerSettings: what the HTTP layer needs to know beyond the engine (names, API key, body limit)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_request_bytes: int = 16 << 20  # as --max-request-bytes' default
    ui: bool = True  # the playground and dashboard at / (--no-ui: off)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]
