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
        # Per request: prompt tokens, reused from the prefix cache, recomputed, anchor used.
        "prefix_reuse": engine.reuse.snapshot(),
        "anchors": None if engine.anchors is None else engine.anchors.snapshot(),
        "moe": None if moe is None else {"strategy": moe.strategy, **moe.telemetry.snapshot()},
        "prefill_streaming": None
        if moe is None or moe.streamer is None
        else {k: v for k, v in vars(moe.streamer.counters).items() if k != "history"},
    }


def metrics_text(core: GenerationCore) -> str:
    s = stats_json(core)
    lines = []

    def metric(name: str, kind: str, help_: str, value: float) -> None:
        lines.extend(
            [
                f"# HELP freetoken_{name} {help_}",
                f"# TYPE freetoken_{name} {kind}",
                f"freetoken_{name} {value}",
            ]
        )

    metric("requests_running", "gauge", "Requests being generated.", s["requests"]["running"])
    metric("requests_queued", "gauge", "Requests waiting for a slot.", s["requests"]["queued"])
    metric(
        "requests_preempted",
        "gauge",
        "Requests waiting to resume after their KV was taken for older ones.",
        s["requests"]["preempted"],
    )
    metric(
        "preemptions_total",
        "counter",
        "Times a request's KV was taken for an older request.",
        s["requests"]["preemptions"],
    )
    metric("prefill_tokens_total", "counter", "Prompt tokens prefilled.", s["tokens"]["prefill"])
    metric("decode_tokens_total", "counter", "Tokens decoded.", s["tokens"]["decode"])
    metric("ttft_seconds_mean", "gauge", "Mean time to first token.", s["ttft_seconds"]["mean"])
    metric(
        "ttft_seconds_p95",
        "gauge",
        "95th percentile time to first token.",
        s["ttft_seconds"]["p95"],
    )
    metric("kv_pages_used", "gauge", "KV cache pages in use.", s["kv_pages"]["used"])
    metric("kv_pages_free", "gauge", "KV cache pages free.", s["kv_pages"]["free"])
    metric(
        "kv_pages_cached", "gauge", "KV pages held by the prefix cache.", s["kv_pages"]["cached"]
    )
    reuse = s["prefix_reuse"]
    metric("prompt_tokens_reused_total", "counter", "Prompt tokens reused.", reuse["reused_tokens"])
    metric(
        "prompt_tokens_recomputed_total",
        "counter",
        "Prompt tokens computed.",
        reuse["recomputed_tokens"],
    )
    metric(
        "anchor_restores_total",
        "counter",
        "Requests resumed from an anchor checkpoint.",
        reuse["anchor_restores"],
    )
    if s["prefill_streaming"] is not None:
        p = s["prefill_streaming"]
        metric(
            "prefill_stream_bytes_h2d_total",
            "counter",
            "Streamed prefill bytes over PCIe.",
            p["bytes_h2d"],
        )
        metric(
            "prefill_stream_bytes_d2d_total",
            "counter",
            "Streamed prefill bytes on device.",
            p["bytes_d2d"],
        )
        metric(
            "prefill_stream_copy_wait_seconds_total",
            "counter",
            "Time the GPU waited for streamed prefill copies.",
            p["copy_wait_s"],
        )
    if s["moe"] is not None:
        t = s["moe"]["total"]
        metric("moe_cache_hit_rate", "gauge", "Expert cache hit rate.", s["moe"]["hit_rate"])
        for key in ("accesses", "hits", "misses", "fills", "cpu", "bytes_h2d"):
            metric(
                f"moe_{key}_total", "counter", f"Expert {key} (distinct pairs per step).", t[key]
            )
    return "\n".join(lines) + "\n"
