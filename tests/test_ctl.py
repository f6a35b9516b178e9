"""`ft ctl status` against a running server: the expert cache against the pool, its hit rate
and split, KV use; the API key honoured; a clear error where no server answers."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken.cli.main import main
from server_fixtures import MODEL, demo_engine, running_server


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def test_status_shows_the_split_the_hit_rate_and_kv_use(engine, capsys):
    with running_server(engine, api_key="sekret") as (base, _core):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        auth = {"Authorization": "Bearer sekret"}
        reply = httpx.post(base + "/v1/completions", headers=auth, json=body, timeout=60)
        assert reply.status_code == 200  # some MoE traffic
        assert main(["ctl", "status", "--url", base, "--api-key", "sekret"]) == 0
        text = capsys.readouterr().out
        moe = engine.runner.moe
        assert f"hybrid: cache of {moe.cache.num_slots} of {moe.store.num_pairs} experts" in text
        assert "hit rate" in text and "on the CPU (m - q)" in text
        assert "pages in use" in text and "16 tokens a page" in text
        assert main(["ctl", "status", "--url", base, "--api-key", "sekret", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["moe"]["cache_slots"] == moe.cache.num_slots
        assert stats["moe"]["cache_bytes"] == moe.cache.num_slots * moe.store.shape.nbytes
        # without the key: a clear error, not a traceback
        assert main(["ctl", "status", "--url", base]) == 2
        assert "wants an API key" in capsys.readouterr().err


def test_status_without_a_server_says_so(capsys):
    assert main(["ctl", "status", "--url", "http://127.0.0.1:9"]) == 2
    assert "no server answers at http://127.0.0.1:9" in capsys.readouterr().err
