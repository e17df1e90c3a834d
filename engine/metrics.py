"""The server's /metrics, through prometheus_client as vLLM serves them: the engine's figures under
our names (llama3:...) and, where vLLM exports the same figure, under its names too (vllm:...), so
that its dashboards read them here.

The engine's process sends, with every step's message, its gauges and running totals and the
latencies it observed since its last message (`EngineFigures`); the server keeps the latest
totals and observes each latency once into Prometheus histograms (`ServerMetrics`).
"""

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets: time to first token and end to end; between tokens
LATENCY_BOUNDS_S = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BOUNDS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                        5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

GAUGES = {
    "num_requests_running": "requests in the running batch",
    "num_requests_waiting": "requests queued for blocks",
    "kv_blocks_used": "KV blocks held by requests",
    "kv_blocks_free": "KV blocks on the free list",
    "kv_cache_usage_perc": "KV blocks used, a fraction of the pool (1 = full)",
    "kv_reserved_bytes": "bytes of blocks owned by running requests",
    "kv_filled_bytes": "of those, bytes holding a token's K and V",
    "kv_unfilled_bytes": "reserved minus filled: the fragmentation",
}
COUNTERS = {  # exported with Prometheus' _total suffix
    "num_preemptions": "running requests sent back to the queue",
    "prompt_tokens": "prompt tokens of the requests taken",
    "generation_tokens": "tokens generated",
    "request_success": "sequences finished or aborted",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("from arrival at the engine to the first token",
                                    LATENCY_BOUNDS_S),
    "inter_token_latency_seconds": ("from a request's token to its next", INTER_TOKEN_BOUNDS_S),
    "e2e_request_latency_seconds": ("from arrival at the engine to the last token",
                                    LATENCY_BOUNDS_S),
}
VLLM_HAS = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
            *HISTOGRAMS}


def prefixes(name: str) -> tuple[str, ...]:
    return ("llama3", "vllm") if name in VLLM_HAS else ("llama3",)


class EngineFigures:
    """The engine process's side: what each step's message carries for /metrics. Latencies run
    from a request's arrival at the engine's process to its tokens on the host, what
    tools/latency_sweep.py measures in one process, so that a client's time less these is
    HTTP's own (tools/serve_bench.py prints both)."""

    def __init__(self):
        self.observed = {name: [] for name in HISTOGRAMS}  # since the last message
        self.seen = {}  # (request id, sample) -> its token times observed

    def observe(self, key: tuple, request, finished: bool) -> None:
        """A sample's new token times, after a step; `finished`: its last step."""
        times, seen = request.token_times, self.seen.get(key, 0)
        if seen == 0 and times:
            self.observed["time_to_first_token_seconds"].append(times[0] - request.arrival_time)
        self.observed["inter_token_latency_seconds"] += [
            times[i] - times[i - 1] for i in range(max(seen, 1), len(times))]
        self.seen[key] = len(times)
        if finished:
            del self.seen[key]
            if times:
                self.observed["e2e_request_latency_seconds"].append(
                    times[-1] - request.arrival_time)

    def take(self, engine) -> dict:
        """The gauges and totals now, and the latencies observed since the last `take`."""
        manager, per_token = engine.manager, engine.kv_bytes_per_token
        reserved, unfilled = manager.num_reserved_slots, manager.num_unfilled_slots
        figures = {
            "num_requests_running": len(engine.scheduler.running),
            "num_requests_waiting": len(engine.scheduler.waiting),
            "kv_blocks_used": manager.num_used_blocks,
            "kv_blocks_free": manager.num_free_blocks,
            "kv_cache_usage_perc": manager.num_used_blocks / manager.num_blocks,  # a fraction
            "kv_reserved_bytes": reserved * per_token,
            "kv_filled_bytes": (reserved - unfilled) * per_token,
            "kv_unfilled_bytes": unfilled * per_token,
            "num_preemptions": engine.scheduler.num_preemptions,  # totals: Prometheus' counters
            "prompt_tokens": engine.num_prompt_tokens,
            "generation_tokens": engine.num_generated_tokens,
            "request_success": engine.num_finished,
            "observed": {name: list(seconds) for name, seconds in self.observed.items()}}
        for seconds in self.observed.values():
            seconds.clear()
        return figures


class ServerMetrics:
    """What /metrics serves for one model: `update` with each message of the engine's,
    `exposition` for a scrape."""

    def __init__(self, model_name: str):
        self.model_name, self.latest = model_name, {}
        self.registry = CollectorRegistry()
        self.registry.register(self)  # the gauges and counters, read from `latest` at a scrape
        self.histograms = {name: [Histogram(f"{prefix}:{name}", help_text, ["model_name"],
                                            registry=self.registry, buckets=bounds
                                            ).labels(model_name)
                                  for prefix in prefixes(name)]
                           for name, (help_text, bounds) in HISTOGRAMS.items()}

    def update(self, figures: dict) -> None:
        """figures: EngineFigures.take's, with under "observed" each histogram's new latencies."""
        for name, seconds in figures.get("observed", {}).items():
            for histogram in self.histograms[name]:
                for value in seconds:
                    histogram.observe(value)
        self.latest = figures

    def collect(self):
        """prometheus_client's collector protocol: the latest gauges and counters."""
        for kinds, family in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for name, help_text in kinds.items():
                if name not in self.latest:
                    continue
                for prefix in prefixes(name):
                    metric = family(f"{prefix}:{name}", help_text, labels=["model_name"])
                    metric.add_metric([self.model_name], self.latest[name])
                    yield metric

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
