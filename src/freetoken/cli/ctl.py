"""`ft ctl`: look at a running server (its /v1/stats), from another terminal."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from freetoken.errors import FreetokenError
from freetoken.weights.memory import gib


def fetch_stats(url: str, api_key: str | None) -> dict:
    key = api_key or os.environ.get("FREETOKEN_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(url.rstrip("/") + "/v1/stats", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise FreetokenError(
                f"{url} wants an API key: --api-key or $FREETOKEN_API_KEY"
            ) from None
        raise FreetokenError(f"{url}/v1/stats answered {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise FreetokenError(f"no server answers at {url} ({e})") from None


def describe(stats: dict) -> list[str]:
    """The status as lines: model, requests, speeds, the expert cache and split, KV use."""
    req, tps, kv = stats["requests"], stats["tokens_per_second"], stats["kv_pages"]
    lines = [
        f"model      {stats['model']}",
        f"requests   {req['running']} running, {req['queued']} queued, "
        f"{req['preemptions']} preemptions",
        f"speed      prefill {tps['prefill']:.1f} tok/s, decode {tps['decode']:.1f} tok/s",
    ]
    moe = stats.get("moe")
    if moe is not None:
        slots, pool = moe["cache_slots"], moe["pool_experts"]
        lines += [
            f"experts    {moe['strategy']}: cache of {slots} of {pool} experts "
            f"({gib(moe['cache_bytes'])} of {gib(moe['pool_bytes'])})",
            f"           hit rate {moe['hit_rate']:.3f}; per layer step "
            f"{moe['mean_fills_per_layer_step']:.2f} filled (q), "
            f"{moe['mean_cpu_per_layer_step']:.2f} on the CPU (m - q)",
        ]
    pages = kv["used"] + kv["cached"] + kv["free"]
    lines.append(
        f"KV cache   {kv['used']} of {pages} pages in use, {kv['cached']} held by the prefix "
        f"cache, {kv['free']} free ({kv['page_size']} tokens a page)"
    )
    return lines


def status(args: argparse.Namespace) -> int:
    stats = fetch_stats(args.url, args.api_key)
    if args.json:
        json.dump(stats, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(describe(stats)))
    return 0
