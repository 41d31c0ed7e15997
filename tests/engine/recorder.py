"""A stand-in metrics observer (engine/output_processor.MetricsObserver) that records every hook call."""

from __future__ import annotations


class Recorder:
    """Every metrics hook call, by name: calls["on_finished"] is the list of its argument tuples."""

    def __init__(self):
        self.calls: dict[str, list] = {}

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)
        return lambda *args: self.calls.setdefault(name, []).append(args)
