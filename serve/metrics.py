"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own so two apps in one process never
share counts.  Names follow Prometheus conventions: base units, ``_total`` for counters."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # the *_created series only repeat the start time
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
RATE_BUCKETS_TOK_S = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("edgekv_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("edgekv_prompt_tokens", "prompt tokens of requests that ran", registry=r)
        self.generation_tokens = Counter("edgekv_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("edgekv_time_to_first_token_seconds", "arrival to first token (queue wait included)",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.inter_token = Histogram("edgekv_inter_token_latency_seconds", "time between a request's tokens",
                                     buckets=ITL_BUCKETS_S, registry=r)
        self.decode_rate = Histogram("edgekv_decode_rate_tokens_per_second",
                                     "per request: tokens after the first / seconds from the first to the last",
                                     buckets=RATE_BUCKETS_TOK_S, registry=r)
        self.kv_bytes_read = Counter("edgekv_kv_bytes_read", "KV bytes read from disk by decode steps", registry=r)
        self.reuse_hits = Counter("edgekv_reuse_hits", "selected KV groups found in the reuse buffer", registry=r)
        self.reuse_lookups = Counter("edgekv_reuse_lookups", "selected KV groups looked up in the reuse buffer",
                                     registry=r)
        self.reuse_rate = Gauge("edgekv_reuse_rate", "reuse hits / lookups since start", registry=r)
        self.decode_seconds = Counter("edgekv_decode_seconds", "seconds spent in decode steps", registry=r)
        self.decode_steps = Counter("edgekv_decode_steps", "decode steps run (each gives every running row a token)",
                                    registry=r)
        self.io_stall_seconds = Counter("edgekv_io_stall_seconds", "seconds decode steps waited for KV reads",
                                        registry=r)
        self.io_stall_share = Gauge("edgekv_io_stall_share", "I/O stall seconds / decode seconds since start", registry=r)
        self.kv_resident_bytes = Gauge("edgekv_kv_resident_bytes", "KV bytes held in memory by the running batch",
                                       registry=r)
        self.running = Gauge("edgekv_requests_running", "sequences in the running batch", registry=r)
        self.waiting = Gauge("edgekv_requests_waiting", "requests queued for a batch row", registry=r)
        self.cancelled = Counter("edgekv_requests_cancelled", "sequences freed because their client left", registry=r)
        self._totals = {"hits": 0, "lookups": 0, "decode_s": 0.0, "stall_s": 0.0}  # what the ratio gauges divide
        self.prompt_tokens_stored = Counter("edgekv_prompt_tokens_from_store",
                                            "prompt tokens whose KV came from the context store", registry=r)

    def sequence_done(self, stats: dict) -> None:
        """A sequence left the batch (finished or cancelled): its share of the KV traffic."""
        t = self._totals
        self.kv_bytes_read.inc(stats.get("kv_bytes_read", 0))
        self.reuse_hits.inc(stats.get("reuse_hits", 0))
        self.reuse_lookups.inc(stats.get("reuse_lookups", 0))
        t["hits"] += stats.get("reuse_hits", 0)
        t["lookups"] += stats.get("reuse_lookups", 0)
        self.reuse_rate.set(t["hits"] / t["lookups"] if t["lookups"] else 0.0)

    def step(self, seconds: float, io_stall_s: float) -> None:
        t = self._totals
        self.decode_seconds.inc(seconds)
        self.decode_steps.inc()
        self.io_stall_seconds.inc(io_stall_s)
        t["decode_s"] += seconds
        t["stall_s"] += io_stall_s
        self.io_stall_share.set(t["stall_s"] / t["decode_s"] if t["decode_s"] else 0.0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
