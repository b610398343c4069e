"""GET /metrics: the engine's STATS reply as Prometheus text, under vLLM's names with our prefix.

Each scrape asks the engine for STATS (docs/protocol.md, STATS_REPLY) and renders it with
prometheus-client: gauges as gauges, counters as counters (`_total`), the per-bucket histograms
as cumulative Prometheus histograms (`_bucket{le}`, `_sum`, `_count`). Every engine series has
a `model_name` label, as vLLM's do. Names are vLLM's with `vllm:` replaced by `paged_run:`
(docs/http.md has the table); a gauge, counter or histogram the engine adds later is exported
under its own STATS name without a change here.

The gateway adds its own: `paged_run:engine_up` (1 when STATS answered) and
`paged_run:http_requests_total{route, status}` (counted by `CountRequests`). With several
gateways in front of one engine, each shows the same engine series: scrape one of them, or
aggregate with `max by` rather than `sum by`.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

PREFIX = "paged_run:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name"]

# Help texts of the series we know; anything else gets a generic one.
HELP = {
    "num_requests_running": "Number of requests in the engine's running batch.",
    "num_requests_waiting": "Number of requests waiting to be scheduled.",
    "kv_cache_usage_perc": "KV-cache usage: 1 means every block is in use (0..1).",
    "num_free_blocks": "Free KV-cache blocks.",
    "num_total_blocks": "KV-cache blocks in all.",
    "server_requests_in_flight": "GENERATEs the ZeroMQ server has in flight.",
    "server_clients_with_requests": "ZeroMQ connections with requests in flight.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "num_preemptions": "Preemptions of running requests (KV cache exhausted).",
    "prompt_tokens": "Prompt tokens processed (prefill).",
    "generation_tokens": "Tokens generated.",
    "request_success": "Requests finished with stop or length.",
    "request_abort": "Requests aborted (client abort, lost client, shutdown).",
    "request_rejected": "Requests answered with an error.",
    "clients_lost": "Requests orphaned by a vanished ZeroMQ client.",
    "messages_received": "ZeroMQ messages the engine server received.",
    "time_to_first_token_seconds": "Time to first token, seconds (engine server side).",
    "time_per_output_token_seconds": "Time per output token after the first, seconds.",
    "e2e_request_latency_seconds": "End-to-end request latency at the engine server, seconds.",
    "request_queue_time_seconds": "Time requests spent waiting to be scheduled, seconds.",
}
# Routes whose requests are counted by name; anything else is "other" (bounded label values).
COUNTED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                  "/version", "/tokenize", "/detokenize", "/metrics")


def _counter_base(name: str) -> str:
    """prometheus-client appends `_total` to a counter family's name itself."""
    return name[:-len("_total")] if name.endswith("_total") else name


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value,
                                                                              bool) else None


def histogram_buckets(h: dict) -> list[tuple[str, float]]:
    """STATS' per-bucket counts ({le, counts: one per bound + the +Inf one}) as Prometheus'
    cumulative (le, count) pairs ending with +Inf."""
    out, total = [], 0
    for le, count in zip(h["le"], h["counts"]):
        total += count
        out.append((repr(float(le)), total))
    out.append(("+Inf", int(h["count"])))
    return out


class _EngineCollector:
    """Renders the STATS snapshot handed to it just before each scrape."""

    def __init__(self) -> None:
        self.stats: dict | None = None
        self.model_name = ""

    def collect(self):
        up = GaugeMetricFamily(PREFIX + "engine_up", "1 when the engine answered STATS.",
                               labels=LABELS)
        up.add_metric([self.model_name], 0.0 if self.stats is None else 1.0)
        yield up
        if self.stats is None:
            return
        labels = [self.model_name]
        for name, value in sorted((self.stats.get("gauges") or {}).items()):
            if _number(value) is not None:
                g = GaugeMetricFamily(PREFIX + name, HELP.get(name, name), labels=LABELS)
                g.add_metric(labels, _number(value))
                yield g
        for name, value in sorted((self.stats.get("counters") or {}).items()):
            if _number(value) is not None:
                base = _counter_base(name)
                c = CounterMetricFamily(PREFIX + base, HELP.get(base, base), labels=LABELS)
                c.add_metric(labels, _number(value))
                yield c
        for name, h in sorted((self.stats.get("histograms") or {}).items()):
            hist = HistogramMetricFamily(PREFIX + name, HELP.get(name, name), labels=LABELS)
            hist.add_metric(labels, histogram_buckets(h), sum_value=float(h["sum"]))
            yield hist


class MetricsExporter:
    """One gateway's registry: the engine's series (from the latest STATS) and its own."""

    def __init__(self) -> None:
        # The `_created` timestamp series prometheus-client adds to every counter mean nothing
        # for counters that start with the process; vLLM drops them too. (Process-wide switch.)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=False)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests by route and "
                                     "status.", ["route", "status"], registry=self.registry)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

    def render(self, stats: dict | None, model_name: str) -> bytes:
        """The text page for this STATS reply (None: the engine did not answer)."""
        self._engine.stats, self._engine.model_name = stats, model_name
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: counts each HTTP request by route and response status."""

    def __init__(self, app, exporter: MetricsExporter) -> None:
        self.app = app
        self.exporter = exporter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in COUNTED_ROUTES else "other"
        status = [500]

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.exporter.http_requests.labels(route, str(status[0])).inc()
