"""`ft ctl`: look at a running server (its /v1/stats) and re-split its memory between the
expert cache and the KV pool (/v1/ctl/cache), from another terminal."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from freetoken import settings
from freetoken.errors import FreetokenError
from freetoken.weights.memory import gib


def call(url: str, api_key: str | None, path: str, body: dict | None = None) -> dict:
    """GET (or with `body`, POST) `path` of the server; its JSON answer."""
    key = api_key or settings.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            wanted = f"{url} wants an API key: --api-key or ${settings.API_KEY.name}"
            raise FreetokenError(wanted) from None
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"status {e.code}"
        raise FreetokenError(f"{url}{path}: {message}") from None
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
            f"{moe['mean_cpu_per_layer_step']:.2f} on the CPU (m - q), "
            f"{moe['mean_prefetches_per_layer_step']:.2f} prefetched",
        ]
    pages = kv["used"] + kv["cached"] + kv["free"]
    lines.append(
        f"KV cache   {kv['used']} of {pages} pages in use, {kv['cached']} held by the prefix "
        f"cache, {kv['free']} free ({kv['page_size']} tokens a page)"
    )
    watch = stats.get("memory_watch")
    if watch:
        lines.append(
            f"moves      expert cache {watch['shrinks']} shrinks, {watch['grows']} grows "
            f"(at most {watch['target_slots']}, at least {watch['floor_slots']} slots); KV pool "
            f"{watch['kv_grows'] + watch['lends']} grows ({watch['lends']} with slots the cache "
            f"lent, {watch['lent_slots']} lent now), {watch['returns']} returns"
        )
    return lines


def status(args: argparse.Namespace) -> int:
    stats = call(args.url, args.api_key, "/v1/stats")
    if args.json:
        json.dump(stats, sys.stdout, indent=2)
        print()
    else:
        print("\n".join(describe(stats)))
    return 0


def cache(args: argparse.Namespace) -> int:
    """Re-split a running server's memory between the expert cache and the KV pool; prints
    the new split."""
    body = {key: value for key, value in (("experts", args.experts), ("kv", args.kv)) if value}
    if not body:
        raise FreetokenError("give --experts SIZE and/or --kv SIZE")
    size = call(args.url, args.api_key, "/v1/ctl/cache", body)
    if "cache_slots" in size:
        print(
            f"expert cache: {size['cache_slots']} of {size['pool_experts']} experts "
            f"({gib(size['cache_bytes'])} of {gib(size['pool_bytes'])})"
        )
    print(
        f"KV cache: {size['kv_tokens']} tokens ({size['kv_pages']} pages, {gib(size['kv_bytes'])})"
    )
    return 0
