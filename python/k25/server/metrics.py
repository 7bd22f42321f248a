"""Prometheus metrics of the server (prefix k25_), on a registry of its own."""
from __future__ import annotations

from typing import Callable, Dict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Metrics:
    def __init__(self, engine_stats: Callable[[], Dict[str, Dict]], admission):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k25_requests", "Requests by endpoint, HTTP status and priority",
                                ["endpoint", "status", "priority"], registry=r)
        self.prompt_tokens = Counter("k25_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("k25_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("k25_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("k25_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT, registry=r)
        self.e2e = Histogram("k25_e2e_request_latency_seconds", "Request latency, arrival to last byte",
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("k25_queue_time_seconds", "Wait for admission (server queue + engine)",
                                    ["priority"], buckets=_LATENCY, registry=r)
        self.degraded = Counter("k25_requests_degraded", "Requests served degraded by the circuit breaker",
                                ["mode", "priority"], registry=r)
        self.rejected = Counter("k25_requests_rejected", "Requests refused (429/503) by reason",
                                ["reason", "priority"], registry=r)
        self.breaker_trips = Gauge("k25_circuit_breaker_level", "0 closed, 1 bronze degraded, 2 bronze+silver",
                                   registry=r)
        r.register(_EngineCollector(engine_stats, admission))


class _EngineCollector:
    """Gauges read at scrape time from the engines and the admission state."""

    def __init__(self, engine_stats, admission):
        self.engine_stats = engine_stats
        self.admission = admission

    def collect(self):
        a = self.admission
        for name, value, doc in (("k25_requests_running", a.running, "Requests generating"),
                                 ("k25_requests_queued", a.queued, "Requests waiting in memory"),
                                 ("k25_requests_spooled", a.spooled, "Requests waiting with the body on disk")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        used = GaugeMetricFamily("k25_kv_blocks_used", "KV blocks in use", labels=["model", "tier"])
        free = GaugeMetricFamily("k25_kv_blocks_free", "KV blocks free", labels=["model", "tier"])
        pre = CounterMetricFamily("k25_preemptions", "Sequences preempted (recompute)", labels=["model"])
        sparsity = GaugeMetricFamily("k25_sparsity_ratio", "Running average of skipped KV blocks", labels=["model"])
        offload = CounterMetricFamily("k25_offload", "KV blocks moved between tiers", labels=["model"])
        prefix_q = CounterMetricFamily("k25_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                       labels=["model"])
        prefix_h = CounterMetricFamily("k25_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                       labels=["model"])
        layer_ratio = GaugeMetricFamily("k25_sparsity_layer_ratio", "Skipped KV blocks per layer since start",
                                        labels=["model", "layer"])
        layer_entropy = GaugeMetricFamily("k25_sparsity_layer_entropy_bits",
                                          "Mean entropy of estimated attention mass over blocks, per layer",
                                          labels=["model", "layer"])
        yield from tier_metrics(self.engine_stats())
        for model, s in self.engine_stats().items():
            for i, layer in enumerate(s.get("sparsity_layers", [])):
                layer_ratio.add_metric([model, str(i)], layer["ratio"])
                layer_entropy.add_metric([model, str(i)], layer["mean_entropy_bits"])
            used.add_metric([model, "l1"], s["blocks_used"])
            free.add_metric([model, "l1"], s["blocks_free"])
            pre.add_metric([model], s["preemptions"])
            sparsity.add_metric([model], s.get("sparsity_ratio", 0.0))
            offload.add_metric([model], s.get("offload_count", 0))
            prefix_q.add_metric([model], s.get("prefix_cache_queries", 0))
            prefix_h.add_metric([model], s.get("prefix_cache_hits", 0))
        yield from (used, free, pre, sparsity, offload, prefix_q, prefix_h, layer_ratio, layer_entropy)


def tier_metrics(engine_stats: Dict[str, Dict]):
    """The KV tiers of models with cache_mode='hierarchical' (stats["tiers"], from
    K25Model.tier_stats()): transfer latency histograms, bytes and fetches per tier, faults."""
    latency = HistogramMetricFamily("k25_offload_latency_seconds",
                                    "KV tier transfer latency: offload (L1 -> L2/L3), fetch (-> L1), spill (L2 -> L3)",
                                    labels=["model", "op"])
    moved = CounterMetricFamily("k25_kv_tier_bytes", "KV bytes moved between L1 and a tier",
                                labels=["model", "tier", "direction"])
    fetches = CounterMetricFamily("k25_kv_tier_fetches", "KV blocks fetched back into L1, by the tier that had them",
                                  labels=["model", "tier"])
    faults = CounterMetricFamily("k25_kv_tier_faults", "KV tier transfers that failed, by reason",
                                 labels=["model", "reason"])
    held = GaugeMetricFamily("k25_kv_tier_blocks", "KV block copies a tier holds now (parked, cached prefix, cold)",
                             labels=["model", "tier"])
    reads = CounterMetricFamily("k25_kv_predictor_reads", "Decode attention block reads (one per layer and KV head) "
                                "by where the block was: l1 (a hit), l2 (a cold block read in place) or l3 (a cold "
                                "block read back from the file), the last two misses",
                                labels=["model", "tier"])
    promotions = CounterMetricFamily("k25_kv_predictor_promotions",
                                     "Cold blocks the tier predictor started copying back to L1", labels=["model"])
    for model, s in engine_stats.items():
        t = s.get("tiers")
        if not t:
            continue
        for op in ("offload", "fetch", "spill"):
            h = t[f"{op}_latency"]
            buckets, total = [], 0
            for bound, n in zip(h["bounds"], h["counts"]):
                total += n
                buckets.append((repr(float(bound)), total))
            buckets.append(("+Inf", h["count"]))
            latency.add_metric([model, op], buckets, h["sum"])
        for tier in ("l2", "l3"):
            moved.add_metric([model, tier, "out"], t[f"bytes_to_{tier}"])
            moved.add_metric([model, tier, "in"], t[f"bytes_from_{tier}"])
            fetches.add_metric([model, tier], t[f"fetches_from_{tier}"])
            held.add_metric([model, tier], t[f"{tier}_blocks"])
        for reason, n in t["faults"].items():
            faults.add_metric([model, reason], n)
        p = s.get("predictor", {})
        reads.add_metric([model, "l1"], p.get("reads_l1", 0))
        reads.add_metric([model, "l2"], p.get("reads_l2", 0))
        reads.add_metric([model, "l3"], p.get("reads_l3", 0))
        promotions.add_metric([model], p.get("promotions", 0))
    yield from (latency, moved, fetches, faults, held, reads, promotions)
