"""/metrics of a server with several models: every loaded model's own ServerMetrics (one registry each, every series
labelled model_name) and the pool's state, rendered as one exposition.

Each registry alone is valid text; concatenated they are not (a metric family's HELP and TYPE must appear once), so a
collector merges the families of the same name into one before rendering. The pool's own series are computed at
scrape time from the entries: tokenmill_model_state (1 for each model's current state), in-flight requests,
counted bytes, loads, unloads by reason, the last load's seconds; refusals of the outer app (a key, an unknown
model) are counted in tokenmill_pool_requests_rejected by status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tokenmill.server.model_pool import STATES, ModelPool


class MergedCollector:
    """The metric families of several registries, those of one name merged into one family."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]):
        self.registries = registries

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries():
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                elif merged.type != family.type:  # not ours to fix: keep the first, say nothing wrong
                    continue
                merged.samples.extend(family.samples)
        return list(families.values())


class PoolCollector:
    """The pool's entries as metric families, read at each scrape."""

    def __init__(self, pool: ModelPool):
        self.pool = pool

    def collect(self) -> Iterable[Metric]:
        state = GaugeMetricFamily("tokenmill_model_state", "1 for each configured model's current state (unloaded, "
                                  "loading, loaded, unloading)", labels=["model_name", "state"])
        in_flight = GaugeMetricFamily("tokenmill_model_requests_in_flight", "Requests a model is answering, "
                                      "streams included: a model with none may be evicted", labels=["model_name"])
        held = GaugeMetricFamily("tokenmill_model_memory_bytes", "Weights + KV cache bytes a model holds against "
                                 "--memory-limit (its estimate while loading)", labels=["model_name"])
        loads = CounterMetricFamily("tokenmill_model_loads", "Loads by outcome", labels=["model_name", "outcome"])
        unloads = CounterMetricFamily("tokenmill_model_unloads", "Unloads by reason: evicted (LRU), keep_alive, "
                                      "memory, too_large, engine_dead, shutdown", labels=["model_name", "reason"])
        seconds = GaugeMetricFamily("tokenmill_model_load_seconds", "The last load's time, engine start to ready",
                                    labels=["model_name"])
        for e in self.pool.entries.values():
            for s in STATES:
                state.add_metric([e.name, s], 1.0 if e.state == s else 0.0)
            in_flight.add_metric([e.name], e.in_flight)
            held.add_metric([e.name], e.bytes)
            loads.add_metric([e.name, "ok"], e.loads)
            loads.add_metric([e.name, "failed"], e.failures)
            for reason, n in e.unloads.items():
                unloads.add_metric([e.name, reason], n)
            if e.load_seconds is not None:
                seconds.add_metric([e.name], e.load_seconds)
        return [state, in_flight, held, loads, unloads, seconds]


class PoolMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pool: ModelPool):
        self.pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PoolCollector(pool))
        self.rejected = Counter("tokenmill_pool_requests_rejected", "Requests refused before reaching a model "
                                "(key, size, unknown model, no room), by HTTP status", ["status"],
                                registry=self.registry)
        self._merged = CollectorRegistry(auto_describe=False)
        self._merged.register(MergedCollector(self._registries))

    def _registries(self) -> list[CollectorRegistry]:
        models = [e.loaded.registry for e in self.pool.entries.values()
                  if e.loaded is not None and e.loaded.registry is not None]
        return [self.registry, *models]

    def on_rejected(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self._merged)
