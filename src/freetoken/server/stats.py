"""/v1/stats (JSON) and /metrics (Prometheus text) from the scheduler, KV and MoE telemetry."""

from __future__ import annotations

from typing import Any

from freetoken.server.core import GenerationCore


def kv_pages(engine) -> dict[str, int]:
    """Pages used by running requests, held by the prefix cache (reusable, evicted when the
    pool runs short), and free."""
    kv, tree = engine.runner.kv, engine.prefix_cache
    cached = tree.num_pages if tree is not None else 0
    free = kv.allocator.num_free
    return {
        "used": kv.num_pages - free - cached,
        "cached": cached,
        "free": free,
        "page_size": kv.page_size,
    }


def cache_size(moe) -> dict[str, int]:
    """The expert cache's slots and bytes beside the whole pool's (the VRAM split)."""
    per_expert, pool = moe.store.shape.nbytes, moe.store.num_pairs
    slots = moe.cache.num_slots if moe.cache is not None else 0
    return {
        "cache_slots": slots,
        "cache_bytes": slots * per_expert,
        "pool_experts": pool,
        "pool_bytes": pool * per_expert,
    }


def memory_split(engine) -> dict[str, Any]:
    """The expert cache's and the KV pool's sizes (what POST /v1/ctl/cache answers)."""
    runner = engine.runner
    kv = runner.kv
    out: dict[str, Any] = {
        "kv_pages": kv.num_pages,
        "kv_tokens": kv.capacity_tokens,
        "kv_bytes": kv.num_pages * kv.page_bytes,
    }
    if runner.moe is not None:
        out.update(cache_size(runner.moe))
    return out


def stats_json(core: GenerationCore) -> dict[str, Any]:
    s = core.scheduler.stats()
    engine = core.scheduler.engine
    ttft = sorted(s.ttft)
    moe = engine.runner.moe
    return {
        "model": core.model_name,
        "requests": {
            "running": s.running,
            "queued": s.queued,
            "preempted": s.preempted,
            "preemptions": s.preemptions,
        },
        "tokens_per_second": {
            "prefill": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
            "decode": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
        },
        "tokens": {"prefill": s.prefill_tokens, "decode": s.decode_tokens},
        "ttft_seconds": {
            "mean": sum(ttft) / len(ttft) if ttft else 0.0,
            "p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))] if ttft else 0.0,
        },
        "kv_pages": kv_pages(engine),
        # Speculative decoding (engine/speculative.py): draft tokens verified and kept.
        "speculative": {
            "on": engine.drafter is not None,
            "drafted": engine.drafted,
            "accepted": engine.accepted,
            "verify_steps": engine.verified,  # a request's step verifying a draft
        },
        # Per request: prompt tokens, reused from the prefix cache, recomputed, anchor used.
        "prefix_reuse": engine.reuse.snapshot(),
        "anchors": None if engine.anchors is None else engine.anchors.snapshot(),
        "memory_watch": None if engine.memory_watch is None else engine.memory_watch.snapshot(),
        "moe": None
        if moe is None
        else {"strategy": moe.strategy, **cache_size(moe), **moe.telemetry.snapshot()},
        "prefill_streaming": None
        if moe is None or moe.streamer is None
        else {k: v for k, v in vars(moe.streamer.counters).items() if k != "history"},
    }


class Metrics:
    """Prometheus metrics of one server (its own registry, so several servers in one process,
    as in the tests, do not share them): latency histograms the core observes, and the
    snapshot of `/v1/stats` as gauges and counters, read when scraped."""

    # Seconds: from a fraction of a decode step to a long prefill behind a queue.
    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

    def __init__(self, core: GenerationCore):
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds",
            "From a request's arrival to its first output token.",
            buckets=self.LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "freetoken_inter_token_latency_seconds",
            "Between consecutive output tokens of a request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.duration = Histogram(
            "freetoken_request_duration_seconds",
            "From a request's arrival to its last output token.",
            buckets=self.LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(core))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _SnapshotCollector:
    """/v1/stats as Prometheus families, computed at each scrape."""

    def __init__(self, core: GenerationCore):
        self.core = core

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = stats_json(self.core)
        reuse = s["prefix_reuse"]
        gauges = [
            ("requests_running", "Requests admitted and not finished.", s["requests"]["running"]),
            ("requests_queued", "Requests waiting for a slot.", s["requests"]["queued"]),
            (
                "requests_preempted",
                "Requests waiting to resume after their KV was taken for older ones.",
                s["requests"]["preempted"],
            ),
            ("kv_pages_used", "KV cache pages in use.", s["kv_pages"]["used"]),
            ("kv_pages_free", "KV cache pages free.", s["kv_pages"]["free"]),
            ("kv_pages_cached", "KV pages held by the prefix cache.", s["kv_pages"]["cached"]),
        ]
        counters = [
            (
                "preemptions",
                "Times a request's KV was taken for an older request.",
                s["requests"]["preemptions"],
            ),
            ("prefill_tokens", "Prompt tokens prefilled.", s["tokens"]["prefill"]),
            ("decode_tokens", "Tokens decoded.", s["tokens"]["decode"]),
            ("prompt_tokens_reused", "Prompt tokens reused.", reuse["reused_tokens"]),
            ("prompt_tokens_recomputed", "Prompt tokens computed.", reuse["recomputed_tokens"]),
            (
                "anchor_restores",
                "Requests resumed from an anchor checkpoint.",
                reuse["anchor_restores"],
            ),
            (
                "draft_tokens",
                "Drafted tokens verified (speculative decoding).",
                s["speculative"]["drafted"],
            ),
            (
                "draft_tokens_accepted",
                "Drafted tokens the model's own choices confirmed.",
                s["speculative"]["accepted"],
            ),
            (
                "draft_verify_steps",
                "Requests' steps that verified a draft.",
                s["speculative"]["verify_steps"],
            ),
        ]
        if s["prefill_streaming"] is not None:
            p = s["prefill_streaming"]
            counters += [
                ("prefill_stream_bytes_h2d", "Streamed prefill bytes over PCIe.", p["bytes_h2d"]),
                ("prefill_stream_bytes_d2d", "Streamed prefill bytes on device.", p["bytes_d2d"]),
                (
                    "prefill_stream_copy_wait_seconds",
                    "Time the GPU waited for streamed prefill copies.",
                    p["copy_wait_s"],
                ),
            ]
        if s["moe"] is not None:
            t = s["moe"]["total"]
            gauges.append(("moe_cache_hit_rate", "Expert cache hit rate.", s["moe"]["hit_rate"]))
            counters += [
                (f"moe_{key}", f"Expert {key} (distinct pairs per step).", t[key])
                for key in ("accesses", "hits", "misses", "fills", "cpu", "prefetches", "bytes_h2d")
            ]
        for name, help_, value in gauges:
            yield GaugeMetricFamily(f"freetoken_{name}", help_, value=value)
        for name, help_, value in counters:
            yield CounterMetricFamily(f"freetoken_{name}", help_, value=value)
