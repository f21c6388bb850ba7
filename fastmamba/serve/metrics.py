"""The server's Prometheus metrics, named as vLLM's with a `fastmamba:` prefix, in a registry
of their own (one a server: each Ray Serve front end has its own)."""

from __future__ import annotations

from fastmamba.engine.protocol import Stats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
HISTOGRAMS = {
    "time_to_first_token_seconds": "time from arrival to the first token",
    "inter_token_latency_seconds": "time between a request's tokens",
    "e2e_request_latency_seconds": "time from arrival to the last token",
    "request_queue_time_seconds": "time from arrival to a state slot",
}
GAUGES = {
    "num_requests_running": "requests holding a state slot",
    "num_requests_waiting": "requests queued for a slot",
    "state_slots_used": "state slots in use",
}
COUNTERS = {
    "prompt_tokens_total": "prompt tokens admitted",
    "generation_tokens_total": "tokens generated",
    "prefix_cache_queries_total": "prefix cache lookups",
    "prefix_cache_hits_total": "prefix cache hits",
    "request_success_total": "requests finished",
}


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        self._m = {}
        for name, doc in HISTOGRAMS.items():
            self._m[name] = Histogram(f"fastmamba:{name}", doc, buckets=LATENCY_BUCKETS, registry=reg)
        for name, doc in GAUGES.items():
            self._m[name] = Gauge(f"fastmamba:{name}", doc, registry=reg)
        for name, doc in COUNTERS.items():
            self._m[name] = Counter(f"fastmamba:{name[: -len('_total')]}", doc, registry=reg)
        self._seen = Stats()  # the engine's cache counters already counted

    def observe(self, name: str, value: float) -> None:
        self._m[name].observe(value)

    def count(self, name: str, n: int = 1) -> None:
        self._m[name].inc(n)

    def update(self, stats: Stats) -> None:
        """The engine's stats (sent with each step's outputs) into the gauges and counters."""
        self._m["num_requests_running"].set(stats.running)
        self._m["state_slots_used"].set(stats.running)
        self._m["num_requests_waiting"].set(stats.waiting)
        if stats.cache_queries > self._seen.cache_queries:
            self._m["prefix_cache_queries_total"].inc(stats.cache_queries - self._seen.cache_queries)
        if stats.cache_hits > self._seen.cache_hits:
            self._m["prefix_cache_hits_total"].inc(stats.cache_hits - self._seen.cache_hits)
        self._seen = Stats(cache_queries=max(stats.cache_queries, self._seen.cache_queries),
                           cache_hits=max(stats.cache_hits, self._seen.cache_hits))

    def page(self) -> tuple[bytes, str]:
        """The metrics page and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
