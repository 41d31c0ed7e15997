"""The router's /metrics: requests by replica and outcome, retries, the replicas' health, load and in-flight counts,
the cascade's answers and costs, the prefill/decode proxy's halves."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from tokenmill.router.replicas import ReplicaPool

_PD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _PoolCollector:
    """The replicas' state, read at scrape time (`prefix`: a second pool's, e.g. the prefill instances)."""

    def __init__(self, pool: ReplicaPool, prefix: str = ""):
        self.pool = pool
        self.name = "tokenmill_router_" + (prefix + "_" if prefix else "") + "backend_"

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(self.name + "healthy", "1 while the replica is in rotation", labels=["backend"])
        in_flight = GaugeMetricFamily(self.name + "in_flight", "Requests the router has in flight there",
                                      labels=["backend"])
        load = GaugeMetricFamily(self.name + "load", "In flight plus the replica's own waiting queue",
                                 labels=["backend"])
        for b in list(self.pool.backends.values()):
            healthy.add_metric([b.url], 1.0 if b.healthy else 0.0)
            in_flight.add_metric([b.url], b.in_flight)
            load.add_metric([b.url], b.load)
        yield from (healthy, in_flight, load)


class RouterMetrics:
    def __init__(self, pool: ReplicaPool, prefill: ReplicaPool | None = None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tokenmill_router_requests", "Requests forwarded, by replica and outcome (ok: the "
                                "response began; error: unreachable or failed midway; retried: skipped for another)",
                                ["backend", "outcome"], registry=r)
        self.unrouted = Counter("tokenmill_router_unrouted", "Requests no replica could take (503)", registry=r)
        self.answered = Counter("tokenmill_router_cascade_answers", "Requests answered, by cascade tier", ["tier"],
                                registry=r)
        self.escalated = Counter("tokenmill_router_cascade_escalations", "Answers judged unsure, by the tier that "
                                 "gave them", ["tier"], registry=r)
        self.spent = Counter("tokenmill_router_cost_usd", "What the answered requests cost, every tier they touched",
                             registry=r)
        self.if_largest = Counter("tokenmill_router_cost_if_last_tier_usd", "What they would have cost sent to the "
                                  "last tier alone (its prices, the answering tier's token counts)", registry=r)
        r.register(_PoolCollector(pool))
        if prefill is not None:
            r.register(_PoolCollector(prefill, "prefill"))
        self.pd_requests = Counter("tokenmill_router_pd_requests", "Prefill/decode requests by how their KV went: sent "
                                   "(the decode instance took it), failed (it computed the prompt itself), "
                                   "prefill_error (no prefill instance answered: the decode instance computed "
                                   "everything)", ["outcome"], registry=r)
        self.pd_prefill = Histogram("tokenmill_router_pd_prefill_seconds", "The prefill half: request to answer (the "
                                    "prompt computed and its KV shipped)", buckets=_PD_BUCKETS, registry=r)
        self.pd_transfer = Histogram("tokenmill_router_pd_transfer_tail_seconds", "Of the prefill half, the KV "
                                     "transfer after the prompt's last step (the rest overlaps the prefill)",
                                     buckets=_PD_BUCKETS, registry=r)
        self.pd_first_decode = Histogram("tokenmill_router_pd_first_decode_seconds", "The decode half: request to the "
                                         "first byte of its answer", buckets=_PD_BUCKETS, registry=r)
        self.pd_bytes = Counter("tokenmill_router_pd_kv_bytes", "KV bytes prefill instances shipped", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
