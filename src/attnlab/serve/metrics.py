"""`GET /metrics`: the server's state and latencies in Prometheus' text format
(prometheus-client), one registry per app.

    attnlab_requests_running / _waiting          requests decoding / queued
    attnlab_kv_blocks_total / _free / _cached    the paged pool (free counts evictable cached blocks)
    attnlab_prefix_cache_hit_ratio               cached blocks found / blocks looked up
    attnlab_requests_total{endpoint}             requests answered
    attnlab_prompt_tokens_total, _generation_tokens_total
    attnlab_time_to_first_token_seconds          histogram: request in -> first token out
    attnlab_inter_token_latency_seconds          histogram: between a request's tokens
    attnlab_engine_step_seconds{kind}            histogram: engine steps that only decode, that
                                                 decode and prefill, or only prefill (the
                                                 decode step, for choosing --max-step-ms)
    attnlab_preemptions_total
    attnlab_graph_compiles_total                 torch.compile graphs built in this process
    attnlab_graph_compiles_serving_total         ... since the engine's warm-up: each one a
                                                 request waited for (0 when every decode size
                                                 was captured at start: decode/engine.py)
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# engine steps: finer where decode steps fall (tens to hundreds of ms), so that the decode step
# read from the histogram is within a bucket's ~15-25 % and not 0.1-0.25 s
_STEP = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4,
         0.5, 0.75, 1, 2.5, 5, 10, 30)  # fmt: skip


class ServeMetrics:
    def __init__(self, stats: Callable[[], dict]) -> None:
        """stats: () -> the worker's stats dict (worker.py), read at every scrape. The worker's
        steps come in through `step` (its on_step, from the engine's thread)."""
        self.stats, r = stats, CollectorRegistry()
        self.registry = r
        g = {}
        for name, what in (
            ("requests_running", "requests decoding"),
            ("requests_waiting", "requests queued"),
            ("kv_blocks_total", "blocks in the KV pool"),
            ("kv_blocks_free", "blocks free or cached without a holder"),
            ("kv_blocks_cached", "blocks the prefix cache holds"),
            ("prefix_cache_hit_ratio", "cached blocks found / looked up"),
            ("preemptions_total", "requests pre-empted (recomputed later)"),
            ("graph_compiles_total", "torch.compile graphs built in this process"),
            ("graph_compiles_serving_total", "graphs built after the engine's warm-up"),
        ):
            g[name] = Gauge(f"attnlab_{name}", what, registry=r)
        self.gauges = g
        self.requests = Counter("attnlab_requests", "requests answered", ["endpoint"], registry=r)
        self.prompt_tokens = Counter("attnlab_prompt_tokens", "prompt tokens", registry=r)
        self.generated = Counter("attnlab_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(
            "attnlab_time_to_first_token_seconds", "request in -> first token", registry=r,
            buckets=_LATENCY,
        )  # fmt: skip
        self.itl = Histogram(
            "attnlab_inter_token_latency_seconds", "between a request's tokens", registry=r,
            buckets=_LATENCY,
        )  # fmt: skip
        self.step_time = Histogram(
            "attnlab_engine_step_seconds", "engine steps by what they computed", ["kind"],
            registry=r, buckets=_STEP,
        )  # fmt: skip

    def step(self, kind: str, seconds: float) -> None:
        """One engine step: what it computed ("decode", "decode+prefill", "prefill") and its
        time (prometheus-client's histograms take observations from any thread)."""
        self.step_time.labels(kind).observe(seconds)

    def scrape(self) -> tuple[bytes, str]:
        s = self.stats()
        g = self.gauges
        g["requests_running"].set(s["running"])
        g["requests_waiting"].set(s["waiting"])
        g["kv_blocks_total"].set(s["blocks_total"])
        g["kv_blocks_free"].set(s["blocks_free"])
        g["kv_blocks_cached"].set(s.get("blocks_cached", 0))
        looked = s.get("prefix_lookup_blocks", 0)
        g["prefix_cache_hit_ratio"].set(s.get("prefix_hit_blocks", 0) / looked if looked else 0.0)
        g["preemptions_total"].set(s["preemptions"])
        g["graph_compiles_total"].set(s["graph_compiles"])
        g["graph_compiles_serving_total"].set(s["graph_compiles_serving"])
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
