"""Prometheus metrics: the router's fleet gauges and counters, the detokenizer's latencies.

The router refreshes its metrics on its periodic tick from the scheduler's counters and the
FleetObserver (a few dozen label updates, whatever the traffic), so scraping costs its step
path nothing. Latency histograms are observed where a request's output is seen, at the
detokenizer, once per request: time to first token and end to end run from the moment
ingest admitted the request (its RequestMeta reaching the detokenizer) to the first token
and the last one printed; time per output token is (end to end - time to first token) /
(tokens - 1). Each process serves its own /metrics endpoint: router.metrics_port and
detokenizer.metrics_port in the topology.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# scheduler counters that are errors, and the kind each is exported as
ERROR_COUNTERS = {"rejected_specs": "rejected_spec", "stale_results": "stale_result",
                  "leases_expired": "lease_expired", "workers_lost": "worker_lost"}


def listen_address(bind: str) -> str:
    """The address /metrics listens on for a node's `bind` ("*" or "": every interface)."""
    return "0.0.0.0" if bind in ("*", "") else bind.strip("[]")


def serve(registry: CollectorRegistry, port: int, bind: str) -> None:
    """Serve /metrics on a daemon thread; a port that is taken is a one-line error."""
    addr = listen_address(bind)
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise SystemExit(f"metrics: cannot listen on {addr}:{port}: {exc.strerror or exc}") from None


class _Deltas:
    """Feeds cumulative values into Prometheus counters, which only take increments."""

    def __init__(self) -> None:
        self.last: dict = {}

    def add(self, counter, key, value: float) -> None:
        delta = value - self.last.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self.last[key] = max(value, self.last.get(key, 0))


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge("qmigrate_queue_depth", "Sequences queued at the router", registry=r)
        self.in_flight = Gauge("qmigrate_sequences_in_flight", "Sequence rows leased to workers", registry=r)
        self.live = Gauge("qmigrate_sequences_live", "Sequences the router holds, queued or leased", registry=r)
        self.workers = Gauge("qmigrate_workers", "Workers by state", ["state"], registry=r)
        self.batch = Gauge("qmigrate_worker_batch_size", "Rows of the last batch leased", ["worker"], registry=r)
        self.rate = Gauge("qmigrate_worker_tokens_per_second", "Tokens generated per second", ["worker"], registry=r)
        self.owned = Gauge("qmigrate_worker_sequences_owned", "Sequences whose KV the worker holds", ["worker"], registry=r)
        self.kv_used = Gauge("qmigrate_kv_blocks_used", "KV blocks in use", ["worker"], registry=r)
        self.kv_free = Gauge("qmigrate_kv_blocks_free", "KV blocks free", ["worker"], registry=r)
        self.tokens = Counter("qmigrate_generated_tokens_total", "Tokens generated", ["worker"], registry=r)
        self.prompt_tokens = Counter("qmigrate_prefix_prompt_tokens_total", "Prompt tokens a worker started "
                                     "sequences from", ["worker"], registry=r)
        self.cached_tokens = Counter("qmigrate_prefix_cached_tokens_total", "Prompt tokens found in a worker's "
                                     "prefix cache", ["worker"], registry=r)
        self.hit_rate = Gauge("qmigrate_prefix_cache_hit_rate", "Share of prompt tokens found cached (worker "
                              "'fleet': all workers)", ["worker"], registry=r)
        self.tier_blocks = Gauge("qmigrate_kv_tier_blocks", "Cached KV blocks a worker holds, per tier (gpu, "
                                 "host), for workers with a host tier", ["worker", "tier"], registry=r)
        self.tier_hits = Counter("qmigrate_kv_tier_hits_total", "Cached KV blocks prompts started on, per tier",
                                 ["worker", "tier"], registry=r)
        self.tier_bytes = Counter("qmigrate_kv_tier_bytes_total", "KV bytes copied into a worker's host tier "
                                  "(in) and back to its GPU (out)", ["worker", "tier", "direction"], registry=r)
        self.finished = Counter("qmigrate_requests_finished_total", "Sequences finished", registry=r)
        self.leases = Counter("qmigrate_leases_total", "Batches leased", registry=r)
        self.migrations = Counter("qmigrate_migrations_total", "Sequences moved between workers", ["cause"], registry=r)
        self.mechanisms = Counter("qmigrate_migrations_by_mechanism_total", "Sequences moved, by how",
                                  ["mechanism"], registry=r)
        self.preemptions = Counter("qmigrate_preemptions_total", "Sequences whose KV a worker evicted for room "
                                   "(recomputed where they run next)", registry=r)
        self.resends = Counter("qmigrate_resends_total", "Sequences a worker gave back for their ids: it had no KV "
                               "for them (rows refused for room, or KV lost)", registry=r)
        self.kv_bytes = Counter("qmigrate_kv_transfer_bytes_total", "KV cache bytes shipped between workers "
                                "(as the router ordered them)", registry=r)
        self.errors = Counter("qmigrate_errors_total", "Errors and dropped messages, by kind", ["kind"], registry=r)
        self.vram_total = Gauge("qmigrate_gpu_memory_total_bytes", "GPU memory", ["node", "gpu"], registry=r)
        self.vram_used = Gauge("qmigrate_gpu_memory_used_bytes", "GPU memory used", ["node", "gpu"], registry=r)
        self.vram_free = Gauge("qmigrate_gpu_memory_free_bytes", "GPU memory free", ["node", "gpu"], registry=r)
        self._deltas = _Deltas()

    def update(self, sched, observer, errors: dict[str, int]) -> None:
        """Refresh from the scheduler and observer: once per tick, not per message."""
        c = sched.counters
        d = self._deltas
        self.queue_depth.set(len(sched.queue))
        self.live.set(len(sched.seqs))
        self.in_flight.set(sum(w.num_leased for w in sched.workers.values() if w.alive))
        states = {"up": 0, "draining": 0, "dead": 0}
        workers, _ = observer.snapshot(sched)
        for (name, _node, _dev, _uuid, state, owned, _leased, batch, rate, kv_used, kv_total, block,
             tokens, _free, prompt_tokens, cached_tokens, *tiers, _prefill_rate) in workers:
            self._tiers(name, tiers)
            d.add(self.prompt_tokens.labels(name), ("prompt", name), prompt_tokens)
            d.add(self.cached_tokens.labels(name), ("cached", name), cached_tokens)
            if prompt_tokens:
                self.hit_rate.labels(name).set(cached_tokens / prompt_tokens)
            states[state if state in states else "up"] += 1
            if state == "dead":
                continue
            self.batch.labels(name).set(batch)
            self.rate.labels(name).set(rate)
            self.owned.labels(name).set(owned)
            if kv_used >= 0:
                self.kv_used.labels(name).set(-(-kv_used // block))
                self.kv_free.labels(name).set((kv_total - kv_used) // block)
            d.add(self.tokens.labels(name), ("tokens", name), tokens)
        for state, n in states.items():
            self.workers.labels(state).set(n)
        if c.get("prefix_prompt_tokens"):
            self.hit_rate.labels("fleet").set(c.get("prefix_cached_tokens", 0) / c["prefix_prompt_tokens"])
        d.add(self.finished, "finished", c.get("finished", 0))
        d.add(self.leases, "leases", c.get("leases", 0))
        for key, value in list(c.items()):
            if key.startswith("migrations_by_"):
                d.add(self.mechanisms.labels(key.removeprefix("migrations_by_")), key, value)
            elif key.startswith("migrations_"):
                d.add(self.migrations.labels(key.removeprefix("migrations_")), key, value)
        for key, kind in ERROR_COUNTERS.items():
            d.add(self.errors.labels(kind), key, c.get(key, 0))
        for kind, value in errors.items():
            d.add(self.errors.labels(kind), ("error", kind), value)
        d.add(self.kv_bytes, "kv_bytes", observer.kv_transfer_bytes)
        d.add(self.preemptions, "evictions", c.get("evictions", 0))
        d.add(self.resends, "resends", c.get("resends", 0))
        for node, uuid, _index, total, used, free, _util in observer.gpus.values():
            self.vram_total.labels(node, uuid).set(total)
            self.vram_used.labels(node, uuid).set(used)
            self.vram_free.labels(node, uuid).set(free)


    def _tiers(self, name: str, tiers: list[int]) -> None:
        """A worker's TIER_STATS columns (-1: it has no host tier)."""
        if len(tiers) != 6 or tiers[0] < 0:
            return
        gpu_blocks, gpu_hits, host_blocks, host_hits, bytes_in, bytes_out = tiers
        d = self._deltas
        for tier, blocks, hits in (("gpu", gpu_blocks, gpu_hits), ("host", host_blocks, host_hits)):
            self.tier_blocks.labels(name, tier).set(blocks)
            d.add(self.tier_hits.labels(name, tier), ("tier_hits", name, tier), hits)
        d.add(self.tier_bytes.labels(name, "host", "in"), ("tier_in", name), bytes_in)
        d.add(self.tier_bytes.labels(name, "host", "out"), ("tier_out", name), bytes_out)


class LatencyMetrics:
    """Per-request latencies, observed once per finished request."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("qmigrate_time_to_first_token_seconds", "Admission at ingest to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("qmigrate_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a request", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("qmigrate_e2e_request_latency_seconds", "Admission at ingest to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.requests = Counter("qmigrate_requests_total", "Requests ended, by outcome", ["outcome"], registry=r)
        self.output_tokens = Counter("qmigrate_output_tokens_total", "Tokens printed", registry=r)

    def finished(self, started: float, first: float | None, now: float, num_tokens: int, reason: str) -> None:
        self.requests.labels(reason).inc()
        self.output_tokens.inc(max(0, num_tokens))
        if first is None:
            return
        self.ttft.observe(first - started)
        self.e2e.observe(now - started)
        if num_tokens > 1:
            self.tpot.observe((now - first) / (num_tokens - 1))

    def failed(self) -> None:
        self.requests.labels("error").inc()
