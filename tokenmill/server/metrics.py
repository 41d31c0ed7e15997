"""Prometheus metrics, one registry per app. The AsyncEngine and its OutputProcessor call the `on_*` hooks
(engine/output_processor.py's MetricsObserver; from the reader thread or the event loop, prometheus-client is
thread-safe); /metrics renders the registry."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0)


_M = ("model_name",)  # every series' label: the served name
_PREDICTION_ERROR_BUCKETS = (-10, -5, -2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 2, 5, 10)

# Every series, in the order the registry lists them (docs/hooks.py builds the metrics reference page from it):
# (attribute, type, series name, labels, histogram buckets or None, help).
_SERIES: tuple[tuple[str, type, str, tuple[str, ...], tuple[float, ...] | None, str], ...] = (
    ("requests", Counter, "tokenmill_requests", ("model_name", "outcome"), None,
     "Finished requests (each of n samples counts) by outcome: stop, length, abort, error"),
    ("rejected", Counter, "tokenmill_requests_rejected", ("model_name", "status"), None,
     "Requests refused before reaching the engine, by HTTP status"),
    ("prompt_tokens", Counter, "tokenmill_prompt_tokens", _M, None, "Prompt tokens of accepted requests"),
    ("generation_tokens", Counter, "tokenmill_generation_tokens", _M, None, "Generated tokens"),
    ("ttft", Histogram, "tokenmill_time_to_first_token_seconds", _M, _LATENCY_BUCKETS, "Arrival to first token"),
    ("itl", Histogram, "tokenmill_inter_token_latency_seconds", _M, _ITL_BUCKETS,
     "Between consecutive tokens of a sample"),
    ("e2e", Histogram, "tokenmill_e2e_request_latency_seconds", _M, _LATENCY_BUCKETS, "Arrival to the last token"),
    ("queue_time", Histogram, "tokenmill_request_queue_time_seconds", _M, _LATENCY_BUCKETS,
     "Arrival to first scheduled"),
    ("running", Gauge, "tokenmill_num_requests_running", _M, None, "Requests the engine is running"),
    ("waiting", Gauge, "tokenmill_num_requests_waiting", _M, None, "Requests waiting in the engine (incl. preempted)"),
    ("waiting_tokens", Gauge, "tokenmill_num_waiting_tokens", _M, None, "Tokens still to compute of waiting requests"),
    ("kv_usage", Gauge, "tokenmill_kv_cache_usage_ratio", _M, None, "Fraction of KV cache blocks in use (0 to 1)"),
    ("preemptions", Counter, "tokenmill_num_preemptions", _M, None, "Requests preempted (recomputed later)"),
    ("aborts", Counter, "tokenmill_request_aborts", _M, None, "Requests aborted (client gone, shutdown)"),
    ("prefill_computed", Counter, "tokenmill_prefill_tokens_computed", _M, None,
     "Prompt tokens run through the model (cache hits excluded, recomputation after preemption included)"),
    ("prefix_queries", Counter, "tokenmill_prefix_cache_queries", _M, None,
     "Prompt tokens looked up in the prefix cache when requests were admitted"),
    ("prefix_hits", Counter, "tokenmill_prefix_cache_hits", _M, None, "Of those, tokens found cached (not recomputed)"),
    ("prefix_hit_rate", Gauge, "tokenmill_prefix_cache_hit_ratio", _M, None, "Prefix cache hits / queries since start"),
    ("prefix_blocks", Gauge, "tokenmill_prefix_cache_blocks", _M, None, "KV blocks held by the prefix cache"),
    ("prefix_evictions", Counter, "tokenmill_prefix_cache_evicted_blocks", _M, None,
     "Cached KV blocks evicted to make room"),
    ("spec_drafts", Counter, "tokenmill_spec_decode_num_drafts", _M, None,
     "Speculative verify passes of one request that carried draft tokens"),
    ("spec_draft_tokens", Counter, "tokenmill_spec_decode_num_draft_tokens", _M, None,
     "Draft tokens proposed and verified"),
    ("spec_accepted", Counter, "tokenmill_spec_decode_num_accepted_tokens", _M, None, "Draft tokens accepted"),
    ("spec_accepted_per_pos", Counter, "tokenmill_spec_decode_num_accepted_tokens_per_pos", ("model_name", "position"),
     None, "Draft tokens accepted, by their position in the draft (0 = first)"),
    ("ttft_by_priority", Histogram, "tokenmill_time_to_first_token_by_priority_seconds", ("model_name", "priority"),
     _LATENCY_BUCKETS, "Arrival to first token, by request priority"),
    ("itl_by_priority", Histogram, "tokenmill_inter_token_latency_by_priority_seconds", ("model_name", "priority"),
     _ITL_BUCKETS, "Between consecutive tokens of a sample, by request priority"),
    ("slo_requests", Counter, "tokenmill_slo_requests", ("model_name", "priority", "outcome"), None,
     ("Finished requests with latency targets, by priority and whether they met every target (TTFT, and mean ITL "
      "as TPOT): goodput is the rate of outcome=met")),
    ("ttft_prediction_error", Histogram, "tokenmill_ttft_prediction_error_seconds", _M, _PREDICTION_ERROR_BUCKETS,
     "Actual minus predicted time to first token (admission's prediction)"),
    ("preemptions_by_cause", Counter, "tokenmill_num_preemptions_by_cause", ("model_name", "cause"), None,
     "Requests preempted, by cause: blocks (the pool ran short) or priority (a better-ranked request took the place)"),
    ("kv_transfer_bytes", Counter, "tokenmill_kv_transfer_bytes", ("model_name", "direction"), None,
     "KV bytes shipped to consumers (sent) or arrived from producers (received), disaggregated prefill/decode"),
    ("kv_transfer_blocks", Counter, "tokenmill_kv_transfer_blocks", ("model_name", "direction"), None,
     "KV blocks (of this engine's block size) sent or received"),
    ("kv_transfers", Counter, "tokenmill_kv_transfers", ("model_name", "outcome"), None,
     ("KV transfers by outcome: sent, send_failed, received, dropped (refused, broken off, expired unclaimed), "
      "missed (a consumer request whose KV had not arrived: it computed its prompt)")),
    ("kv_loaded_tokens", Counter, "tokenmill_kv_transfer_loaded_tokens", _M, None,
     "Prompt tokens a consumer loaded instead of computing"),
    ("kv_transfer_seconds", Histogram, "tokenmill_kv_transfer_seconds", _M, _LATENCY_BUCKETS,
     "Per transfer, from the first KV handed over to the consumer's acknowledgement (overlaps the prefill)"),
    ("kv_rejected_connections", Counter, "tokenmill_kv_transfer_rejected_connections", _M, None,
     "KV transfer connections dropped for not proving they hold kv_secret"),
    ("kv_buffered", Gauge, "tokenmill_kv_transfer_buffered_bytes", _M, None, "Received KV waiting to be claimed"),
    ("leaked_blocks", Gauge, "tokenmill_leaked_blocks", _M, None,
     "KV blocks still held the last time no request was in flight: 0 unless there is a bug"),
    ("engine_alive", Gauge, "tokenmill_engine_alive", _M, None, "1 while the engine loop is alive"),
    ("weight_bytes", Gauge, "tokenmill_model_weight_bytes", ("model_name", "format"), None,
     "Bytes the model's weights hold in the engine, by weight format (as the start-up log says)"),
    ("kv_bytes", Gauge, "tokenmill_kv_cache_bytes", _M, None,
     "Bytes the KV cache holds: its pages and, for a hybrid model, its recurrent-state slots and snapshots"),
    ("state_slots", Gauge, "tokenmill_recurrent_state_slots", _M, None,
     "A hybrid model's recurrent-state slots, one per request that may run (0: no state layers)"),
    ("state_bytes", Gauge, "tokenmill_recurrent_state_bytes_per_request", _M, None,
     "Bytes of one request's recurrent state over every state layer"),
    ("state_snapshots", Gauge, "tokenmill_recurrent_state_snapshots", _M, None,
     "Recurrent states kept at cached block boundaries for prefix hits"),
)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None):
        self.registry = r = CollectorRegistry()
        for attr, kind, name, labels, buckets, doc in _SERIES:
            extra = {} if buckets is None else {"buckets": buckets}
            setattr(self, attr, kind(name, doc, labels, registry=r, **extra))
        self._slo_defaults = (slo_ttft_ms, slo_itl_ms)  # the server's targets for requests that give none
        self._model = m = model_name
        # the latest latencies, (when, seconds), for the dashboard's percentiles over the last minutes (server/ui.py)
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=20_000)
        self.recent_itl: deque[tuple[float, float]] = deque(maxlen=50_000)
        self.rejected_total = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.block_size = 16  # for the blocks counter (app.py sets the engine's)
        # totals last reported (engine stats, KV connector), so the counters take only the increase
        self._causes_seen: dict[str, int] = {}
        self._kv_seen: dict[tuple, int] = {}
        self._spec_seen: tuple[int, ...] = ()
        self.engine_alive.labels(m).set(1)
        # children bound once: .labels() per observation would cost a dict lookup and a lock each time
        self._gen, self._ttft, self._itl = self.generation_tokens.labels(m), self.ttft.labels(m), self.itl.labels(m)
        self._e2e, self._queue = self.e2e.labels(m), self.queue_time.labels(m)
        self._running, self._waiting = self.running.labels(m), self.waiting.labels(m)
        self._waiting_tokens, self._kv = self.waiting_tokens.labels(m), self.kv_usage.labels(m)
        # every series exists (at 0) from the start, so dashboards and rate() see the first event
        self._prompt, self._aborts = self.prompt_tokens.labels(m), self.aborts.labels(m)
        self._preempt = self.preemptions.labels(m)
        self._pq, self._ph = self.prefix_queries.labels(m), self.prefix_hits.labels(m)
        self._prate, self._pblocks = self.prefix_hit_rate.labels(m), self.prefix_blocks.labels(m)
        self._pevict = self.prefix_evictions.labels(m)
        self._leaked = self.leaked_blocks.labels(m)
        self._prefill = self.prefill_computed.labels(m)
        self._from_totals = (self._preempt, self._prefill, self._pq, self._ph, self._pevict)
        self._totals_seen = (0,) * len(self._from_totals)
        for outcome in ("stop", "length", "abort", "error"):
            self.requests.labels(m, outcome)

    def set_weights(self, weight_format: str, weight_bytes: int) -> None:
        """Once the engine is ready: what its weights are and take."""
        self.weight_bytes.labels(self._model, weight_format).set(weight_bytes)

    def set_cache(self, kv_bytes: int, state_slots: int, state_bytes: int, state_snapshots: int) -> None:
        """Once the engine is ready: what its KV cache takes, and a hybrid model's state slots and snapshots."""
        m = self._model
        for gauge, value in ((self.kv_bytes, kv_bytes), (self.state_slots, state_slots),
                             (self.state_bytes, state_bytes), (self.state_snapshots, state_snapshots)):
            gauge.labels(m).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- hooks ----------------------------------------------------------------------------------------------
    def on_added(self, prompt_tokens: int) -> None:
        self._prompt.inc(prompt_tokens)
        self.prompt_tokens_total += prompt_tokens

    def on_started(self, queue_time: float) -> None:
        self._queue.observe(max(queue_time, 0.0))

    def on_first_token(self, ttft: float, request) -> None:
        self.recent_ttft.append((time.monotonic(), ttft))
        self._ttft.observe(ttft)
        self.ttft_by_priority.labels(self._model, str(request.params.priority)).observe(ttft)
        if request.predicted_ttft is not None:
            self.ttft_prediction_error.labels(self._model).observe(ttft - request.predicted_ttft)

    def on_inter_token(self, itl: float, request) -> None:
        self.recent_itl.append((time.monotonic(), itl))
        self._itl.observe(itl)
        self.itl_by_priority.labels(self._model, str(request.params.priority)).observe(itl)

    def on_finished(self, parent, e2e: float) -> None:
        self.on_outcomes([s.finish_reason or "error" for s in parent.samples])
        self._e2e.observe(e2e)
        met = self._met_slo(parent)
        if met is not None:
            self.slo_requests.labels(self._model, str(parent.params.priority), "met" if met else "missed").inc()

    def _met_slo(self, parent) -> bool | None:
        """Whether a finished request met its latency targets (None: it had none): TTFT, and its samples' mean
        time per output token after the first (vLLM's TPOT) against the ITL target."""
        p = parent.params
        ttft_ms, itl_ms = p.slo_ttft_ms or self._slo_defaults[0], p.slo_itl_ms or self._slo_defaults[1]
        if not ttft_ms and not itl_ms:
            return None
        m = parent.metrics
        if m.first_token_time is None or m.finished_time is None:
            return False
        if ttft_ms and (m.first_token_time - m.arrival_time) * 1e3 > ttft_ms:
            return False
        tokens = max(len(s.token_ids) for s in parent.samples)
        if itl_ms and tokens > 1 and (m.finished_time - m.first_token_time) / (tokens - 1) * 1e3 > itl_ms:
            return False
        return not any(s.finish_reason in ("error", "abort") for s in parent.samples)

    def on_outcomes(self, reasons: list[str]) -> None:
        """One count per sample by how it ended."""
        for reason in reasons:
            self.requests.labels(self._model, reason).inc()

    def on_aborted(self, count: int) -> None:
        self._aborts.inc(count)

    def on_rejected(self, status: int) -> None:
        self.rejected_total += 1
        self.rejected.labels(self._model, str(status)).inc()

    def on_engine_dead(self, failed: int) -> None:
        self.engine_alive.labels(self._model).set(0)
        if failed:
            self.requests.labels(self._model, "error").inc(failed)

    def on_stats(self, stats, generated_tokens: int) -> None:
        if generated_tokens:
            self._gen.inc(generated_tokens)
            self.generation_tokens_total += generated_tokens
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._waiting_tokens.set(stats.num_waiting_tokens)
        self._kv.set(stats.kv_usage)
        pc = stats.prefix_cache
        totals = (stats.num_preemptions_total, stats.num_prefill_tokens_computed_total, pc.queries, pc.hits,
                  pc.evicted_blocks)
        if totals != self._totals_seen:  # the engine reports totals since start; counters take the increase
            for counter, new, old in zip(self._from_totals, totals, self._totals_seen):
                if new > old:
                    counter.inc(new - old)
            self._totals_seen = totals
            self._prate.set(pc.hit_rate)
        self._pblocks.set(pc.cached_blocks)
        self._leaked.set(stats.leaked_blocks)
        if stats.spec_decode is not None:
            self._on_spec(stats.spec_decode)
        for cause, total in stats.preemptions_by_cause.items():
            if total > self._causes_seen.get(cause, 0):
                self.preemptions_by_cause.labels(self._model, cause).inc(total - self._causes_seen.get(cause, 0))
                self._causes_seen[cause] = total

    def on_kv_transfer(self, st) -> None:
        """The connector's totals since start -> counter increases; its per-transfer times -> the histogram."""
        m, bs = self._model, self.block_size
        totals = ((self.kv_transfer_bytes, ("sent",), st.sent_bytes),
                  (self.kv_transfer_bytes, ("received",), st.received_bytes),
                  (self.kv_transfer_blocks, ("sent",), -(-st.sent_tokens // bs)),
                  (self.kv_transfer_blocks, ("received",), -(-st.received_tokens // bs)),
                  (self.kv_transfers, ("sent",), st.sent_transfers),
                  (self.kv_transfers, ("send_failed",), st.failed_sends),
                  (self.kv_transfers, ("received",), st.received_transfers),
                  (self.kv_transfers, ("dropped",), st.dropped_transfers),
                  (self.kv_transfers, ("missed",), st.missed_claims),
                  (self.kv_transfers, ("refused_claim",), st.refused_claims),
                  (self.kv_rejected_connections, (), st.rejected_connections),
                  (self.kv_loaded_tokens, (), st.loaded_tokens))
        for metric, labels, total in totals:
            key = (id(metric), *labels)
            seen = self._kv_seen.get(key, 0)
            if total > seen:
                metric.labels(m, *labels).inc(total - seen)
                self._kv_seen[key] = total
        for seconds in st.send_seconds:
            self.kv_transfer_seconds.labels(m).observe(seconds)
        self.kv_buffered.labels(m).set(st.buffered_bytes)

    def _on_spec(self, sd) -> None:
        """Speculation totals since start -> counter increases (as the scheduler totals above)."""
        totals = (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens, *sd.accepted_per_pos)
        if totals == self._spec_seen:
            return
        seen = self._spec_seen + (0,) * (len(totals) - len(self._spec_seen))
        m = self._model
        for counter, new, old in zip((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted), totals, seen):
            if new > old:
                counter.labels(m).inc(new - old)
        for pos, (new, old) in enumerate(zip(totals[3:], seen[3:])):
            if new > old:
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(new - old)
        self._spec_seen = totals
