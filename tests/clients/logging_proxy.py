"""A logging reverse proxy: put it between an agent client and `ft serve` to see the traffic.

Every request is forwarded unchanged and written to OUTDIR/NNN.json (method, path, headers,
JSON body, status and the response as it streamed back, cut to 200 kB, with when each piece
of it arrived), so the exact bodies real clients send can be read and turned into fixtures
(`trim_capture.py`), and a session's timings read back (`agent_task.py`).

    python tests/clients/logging_proxy.py --upstream http://127.0.0.1:1919 --port 2000 OUTDIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "content-encoding", "connection"}


def make_app(upstream: str, outdir: Path) -> Starlette:
    numbers = itertools.count()
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def forward(request: Request):
        record = {
            "n": next(numbers),
            "method": request.method,
            "path": request.url.path,
            "query": str(request.url.query),
            "headers": dict(request.headers),
            "t": time.time(),
        }
        body = await request.body()
        try:
            record["body"] = json.loads(body) if body else None
        except ValueError:
            record["body_raw"] = body.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream_request = client.build_request(request.method, url, headers=headers, content=body)
        response = await client.send(upstream_request, stream=True)
        record["status"] = response.status_code
        chunks: list[bytes] = []
        # (seconds since the request, bytes of the response so far) per piece: which event
        # came when, e.g. the first token after a long prefill's keep-alives
        record["arrivals"] = arrivals = []

        async def relay():
            try:
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    size = (arrivals[-1][1] if arrivals else 0) + len(chunk)
                    arrivals.append((round(time.time() - record["t"], 4), size))
                    yield chunk
            finally:
                record["response"] = b"".join(chunks).decode(errors="replace")[:200_000]
                record["t_end"] = time.time()
                path = outdir / f"{record['n']:03d}.json"
                path.write_text(json.dumps(record, indent=1))
                await response.aclose()

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--upstream", default="http://127.0.0.1:1919")
    parser.add_argument("--port", type=int, default=2000)
    args = parser.parse_args()
    args.outdir.mkdir(parents=True, exist_ok=True)
    uvicorn.run(make_app(args.upstream, args.outdir), port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
