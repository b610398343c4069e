"""Server-side metrics: latency histograms and counters, and the STATS reply they build.

Names follow vLLM's Prometheus metrics without the `vllm:` prefix (num_requests_running,
kv_cache_usage_perc, prefix_cache_queries, time_to_first_token_seconds, ...), so a future
Prometheus exporter only adds the prefix. Engine gauges/counters come from the engine's own
get_stats(); the histograms are measured here, at the socket, because that is what a client sees.
"""
from __future__ import annotations

import bisect

# Bucket upper bounds, seconds. Spans sub-millisecond GPU replies to minute-long CPU prompts.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's request_queue_time_seconds buckets are the e2e ones; ours start lower because a
# request that is scheduled in the step after it arrives waits milliseconds.
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

ENGINE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_free_blocks", "num_total_blocks")
ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions_total",
                   "prompt_tokens_total", "generation_tokens_total")


class Histogram:
    """Cumulative-free bucket counts; `counts[i]` = observations <= le[i] and > le[i-1];
    the last count is the +Inf bucket."""

    def __init__(self, buckets_s: tuple[float, ...]) -> None:
        self.le = list(buckets_s)
        self.counts = [0] * (len(self.le) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.le, value)] += 1
        self.sum += value
        self.count += 1

    def to_wire(self) -> dict:
        return {"le": self.le, "counts": self.counts, "sum": self.sum, "count": self.count}


class ServerMetrics:
    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.tpot = Histogram(TPOT_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)
        self.queue = Histogram(QUEUE_BUCKETS_S)
        self.counters = {
            "request_success_total": 0,   # finished with stop/length
            "request_abort_total": 0,     # aborted by the client, a lost client or shutdown
            "request_rejected_total": 0,  # answered with an error
            "clients_lost_total": 0,      # requests orphaned by a vanished client
            "messages_received_total": 0,
        }

    def stats_body(self, engine_stats: dict, num_in_flight: int, num_clients: int) -> dict:
        gauges = {k: engine_stats.get(k) for k in ENGINE_GAUGES}
        gauges["server_requests_in_flight"] = num_in_flight
        gauges["server_clients_with_requests"] = num_clients
        counters = {k: engine_stats.get(k) for k in ENGINE_COUNTERS}
        counters.update(self.counters)
        return {
            "gauges": gauges,
            "counters": counters,
            "histograms": {
                "time_to_first_token_seconds": self.ttft.to_wire(),
                "time_per_output_token_seconds": self.tpot.to_wire(),
                "e2e_request_latency_seconds": self.e2e.to_wire(),
                "request_queue_time_seconds": self.queue.to_wire(),
            },
        }
