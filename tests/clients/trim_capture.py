"""Turn request bodies captured from real agent clients into small test fixtures.

Captured with `logging_proxy.py` between a client and `ft serve` (see docs/agents.md). The
trimmed body keeps every field, message, content block and tool type the client sent, in
order; it cuts long strings (system prompts, tool descriptions) and keeps a few tools of each
kind, so a test's prompt stays small enough for the demo model on a CPU.

    python tests/clients/trim_capture.py NAME ENDPOINT CLIENT CAPTURE.json [NAME ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_STRING = 240
TOOLS_PER_KIND = 3
FIXTURES = Path(__file__).with_name("requests.json")


def cut(value):
    if isinstance(value, str):
        return value if len(value) <= MAX_STRING else value[:MAX_STRING] + " [...]"
    if isinstance(value, list):
        return [cut(v) for v in value]
    if isinstance(value, dict):
        return {k: cut(v) for k, v in value.items()}
    return value


def trim(body: dict) -> dict:
    body = dict(body)
    if isinstance(body.get("tools"), list):
        kept, seen = [], {}
        for tool in body["tools"]:
            kind = tool.get("type", "function")
            if seen.get(kind, 0) < TOOLS_PER_KIND:
                seen[kind] = seen.get(kind, 0) + 1
                if kind == "namespace":
                    tool = {**tool, "tools": tool["tools"][:TOOLS_PER_KIND]}
                kept.append(tool)
        body["tools"] = kept
    return cut(body)


def main(argv: list[str]) -> None:
    fixtures = json.loads(FIXTURES.read_text()) if FIXTURES.exists() else {}
    for name, endpoint, client, capture in zip(*[iter(argv)] * 4, strict=True):
        record = json.loads(Path(capture).read_text())
        fixtures[name] = {"endpoint": endpoint, "client": client, "body": trim(record["body"])}
    FIXTURES.write_text(json.dumps(fixtures, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
