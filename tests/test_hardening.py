"""What a hostile or careless client cannot do to the server: stall it, leave work running
behind it, get a 500, or outlive a shutdown; and the options it sends are honoured or refused
by name, never silently dropped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import httpx
import pytest

from server_fixtures import MODEL, free_port, running_server

HEALTH_BUDGET = 0.1  # seconds /health may take while another request is being refused

CHAT = "/v1/chat/completions"
GENERATING = {
    CHAT: lambda n: {
        "model": MODEL,
        "max_tokens": n,
        "messages": [{"role": "user", "content": "Go on"}],
    },
    "/v1/completions": lambda n: {"model": MODEL, "max_tokens": n, "prompt": "Go on"},
    "/v1/messages": lambda n: {
        "model": MODEL,
        "max_tokens": n,
        "messages": [{"role": "user", "content": "Go on"}],
    },
    "/v1/responses": lambda n: {"model": MODEL, "max_output_tokens": n, "input": "Go on"},
}


def long_body(path: str, tokens: int = 1500) -> dict:
    return {**GENERATING[path](tokens), "temperature": 0}


def requests_in_flight(base: str) -> tuple[int, int]:
    stats = httpx.get(base + "/v1/stats").json()["requests"]
    return stats["running"], stats["queued"]


def wait_until(predicate, timeout: float, every: float = 0.02) -> float:
    """Seconds until `predicate()` held; fails past `timeout`."""
    start = time.perf_counter()
    while not predicate():
        assert time.perf_counter() - start < timeout, "timed out"
        time.sleep(every)
    return time.perf_counter() - start


def health_latencies(base: str, until: threading.Event, at_least: int = 10) -> list[float]:
    """/health's latency, polled until `until` is set (and at least `at_least` times)."""
    out = []
    with httpx.Client(timeout=5) as client:
        while not until.is_set() or len(out) < at_least:
            start = time.perf_counter()
            assert client.get(base + "/health").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(0.01)
    return out


def in_background(fn):
    """Run `fn` on a thread; returns (thread, done event, result holder)."""
    done, result = threading.Event(), {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # reported by the test that reads it
            result["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, result


# -- size and time bounds -------------------------------------------------------------


def test_oversized_bodies_get_413_while_health_stays_fast(server):
    base, _ = server
    ten_mb = json.dumps({"model": MODEL, "prompt": "x" * (10 * 2**20)}).encode()

    def send_all():
        statuses = []
        with httpx.Client(timeout=60) as client:
            for _ in range(3):
                statuses.append(client.post(base + "/v1/completions", content=ten_mb).status_code)
                # Without a Content-Length (chunked): refused once the limit is passed.
                chunks = (ten_mb[i : i + 2**20] for i in range(0, len(ten_mb), 2**20))
                r = client.post(base + "/v1/messages", content=chunks)
                statuses.append(r.status_code)
                assert r.json()["error"]["type"] == "request_too_large"
        return statuses

    _, done, result = in_background(send_all)
    latencies = health_latencies(base, done)
    assert "error" not in result, result.get("error")
    assert result["value"] == [413] * 6
    assert max(latencies) < HEALTH_BUDGET, max(latencies)
    assert requests_in_flight(base) == (0, 0)


HOSTILE_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)


def chat_with_template(template: str) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"chat_template": template},
    }


def test_client_templates_are_refused_unless_the_operator_allows_them(server):
    r = httpx.post(server[0] + CHAT, json=chat_with_template(HOSTILE_TEMPLATE), timeout=5)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "--allow-request-chat-template" in error["message"]
    assert error["param"] == "chat_template_kwargs.chat_template"


def test_an_allowed_hostile_template_is_cut_off_while_health_stays_fast(fresh_engine):
    from freetoken.server.sandbox import TemplateSandbox

    sandbox = TemplateSandbox(fresh_engine.tokenizer.path, timeout=1.0)
    try:
        with running_server(fresh_engine, MODEL, sandbox=sandbox) as (base, _):
            benign = "{% for m in messages %}{{ m.content }}|{% endfor %}"
            with httpx.Client(timeout=150) as client:
                # The worker starts on first use (it imports transformers): a benign template
                # renders there, with the client's own template.
                ok = client.post(base + CHAT, json=chat_with_template(benign))
                assert ok.status_code == 200, ok.text
                assert ok.json()["usage"]["prompt_tokens"] == len(
                    fresh_engine.tokenizer.encode("hi|")
                )

            def hostile():
                with httpx.Client(timeout=60) as client:
                    start = time.perf_counter()
                    r = client.post(base + CHAT, json=chat_with_template(HOSTILE_TEMPLATE))
                    return r, time.perf_counter() - start

            _, done, result = in_background(hostile)
            latencies = health_latencies(base, done)
            r, seconds = result["value"]
            assert r.status_code == 400 and "ran for over 1 s" in r.json()["error"]["message"]
            assert seconds < 10
            assert max(latencies) < HEALTH_BUDGET, max(latencies)
            # The next template renders in a fresh worker.
            with httpx.Client(timeout=150) as client:
                assert client.post(base + CHAT, json=chat_with_template(benign)).status_code == 200
    finally:
        sandbox.close()


def test_chat_template_kwargs_may_not_set_what_the_renderer_sets(server):
    for key in ("tools", "messages", "add_generation_prompt"):
        body = {**GENERATING[CHAT](2), "chat_template_kwargs": {key: []}}
        r = httpx.post(server[0] + CHAT, json=body)
        assert r.status_code == 400 and key in r.json()["error"]["message"]


# -- nothing left running ---------------------------------------------------------------


def open_request(base: str, path: str, body: dict) -> socket.socket:
    """A raw HTTP request, left open: closing the socket is the client leaving."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.mark.parametrize("path", list(GENERATING))
def test_a_whole_answer_whose_client_left_is_cancelled_within_a_second(server, path):
    base, _ = server
    sock = open_request(base, path, long_body(path))
    wait_until(lambda: requests_in_flight(base)[0] == 1, timeout=30)
    sock.close()
    assert wait_until(lambda: requests_in_flight(base) == (0, 0), timeout=1.0) < 1.0


@pytest.mark.parametrize("path", list(GENERATING))
def test_a_refused_request_never_starts_a_generation(server, path):
    base, _ = server
    r = httpx.post(base + path, json={**long_body(path), "stream": "yes"})
    assert r.status_code == 400
    assert requests_in_flight(base) == (0, 0)


# -- shutdown -------------------------------------------------------------------------


def test_draining_finishes_requests_in_flight_and_refuses_new_ones(fresh_engine):
    with running_server(fresh_engine, MODEL) as (base, core):
        body = {**GENERATING[CHAT](40), "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", base + CHAT, json=body) as r:
                lines = r.iter_lines()
                next(lines)
                core.begin_shutdown(timeout=60)
                refused = httpx.post(base + CHAT, json=GENERATING[CHAT](2))
                rest = [line for line in lines if line.startswith("data: ")]
            assert refused.status_code == 503 and "Retry-After" in refused.headers
            assert httpx.get(base + "/health").json()["status"] == "draining"
        finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
        assert rest[-1] == "data: [DONE]" and finish[-1] == "length"  # ran to its end


def test_sigterm_ends_the_process_within_the_shutdown_timeout(tmp_path):
    """`ft serve` with a streaming and a whole answer in flight: SIGTERM stops it within
    --shutdown-timeout; the stream ends with an error event and [DONE], the whole answer is
    a 503, and the process exits 0."""
    port, timeout = free_port(), 3.0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "freetoken.cli.main",
            "serve",
            "--model",
            "random-demo",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--kv-cache-tokens",
            "4096",
            "--shutdown-timeout",
            str(timeout),
            "--served-model-name",
            MODEL,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(base) or process.poll() is not None, timeout=120, every=0.2)
        assert process.poll() is None, process.stderr.read().decode()[-2000:]

        def stream():
            body = {**long_body(CHAT, 3000), "stream": True}
            with httpx.stream("POST", base + CHAT, json=body, timeout=60) as r:
                return [line for line in r.iter_lines() if line.startswith("data: ")]

        def whole():
            return httpx.post(base + CHAT, json=long_body(CHAT, 3000), timeout=60)

        streaming = in_background(stream)
        answering = in_background(whole)
        wait_until(lambda: requests_in_flight(base)[0] == 2, timeout=30)
        start = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout + 10)
        elapsed = time.perf_counter() - start
        for _, done, _ in (streaming, answering):
            assert done.wait(5)
        lines, response = streaming[2]["value"], answering[2]["value"]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert elapsed < timeout, elapsed
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["type"] == "overloaded_error" and "shut down" in error["message"]
    assert response.status_code == 503 and "shut down" in response.json()["error"]["message"]


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# -- auth and the operator's flags (item 7) -------------------------------------------------


def test_keys_are_compared_in_constant_time_and_bad_ones_refused(fresh_engine, monkeypatch):
    import freetoken.server.app as app_module

    compared = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(
        app_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b)
    )
    with running_server(fresh_engine, MODEL, api_key="sekret") as (base, _):
        for headers in (
            {"authorization": "Bearer sekreT"},  # same length
            {"authorization": "Bearer s"},
            {"x-api-key": "sekret-and-more"},
            {"x-api-key": "s\u00e9kret".encode("latin-1")},  # not ASCII
            {},
        ):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401, headers
        assert httpx.get(base + "/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
    assert len(compared) == 6


def serve_args(**changes) -> Namespace:
    from freetoken.cli.main import build_parser

    return build_parser().parse_args(["serve", *(x for item in changes.items() for x in item)])


def test_an_empty_api_key_is_an_error_not_auth_off(monkeypatch):
    from freetoken import settings
    from freetoken.cli.serve import server_config

    key = settings.API_KEY.name
    monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit, match="--api-key is empty"):
        server_config(serve_args(**{"--api-key": ""}))
    monkeypatch.setenv(key, " ")
    with pytest.raises(SystemExit, match=key):
        server_config(serve_args())
    monkeypatch.setenv(key, "k")
    assert server_config(serve_args()).api_key == "k"


def test_serving_other_machines_without_a_key_warns():
    from freetoken.cli.serve import exposure_warning

    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert "without an API key" in exposure_warning("192.168.1.5", None)
    assert exposure_warning("0.0.0.0", "k") is None
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None


def test_serve_flags_reach_the_engine_config_before_it_is_built():
    from freetoken.cli.options import engine_config

    config = engine_config(
        serve_args(
            **{
                "--max-running-requests": "8",
                "--max-prefill-chunk": "512",
                "--cpu-spin-us": "50",
                "--cpu-prepare-us": "0",
            }
        )
    )
    assert config.max_batch_size == 8 and config.max_prefill_chunk == 512
    assert config.moe.cpu_spin_us == 50 and config.moe.cpu_prepare_us == 0
    from freetoken.config import EngineConfig

    defaults = engine_config(serve_args())
    assert defaults.max_batch_size == EngineConfig.max_batch_size
    assert defaults.max_prefill_chunk == EngineConfig.max_prefill_chunk
    assert defaults.moe.device_control
    from freetoken.cli.main import build_parser

    host = build_parser().parse_args(["serve", "--no-moe-device-control"])
    assert not engine_config(host).moe.device_control


def test_a_hybrid_model_runs_as_many_requests_as_asked(tmp_path):
    """Qwen3-Next's recurrent-state pool is sized from the engine config, which now carries
    --max-running-requests: 8 asked, 8 slots, 8 admitted."""
    from freetoken.config import EngineConfig
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams
    from freetoken.engine.scheduler import Scheduler
    from tiny_models import build_chat_model

    path, _ = build_chat_model("qwen3_next", tmp_path / "qwen3_next")
    engine = LLMEngine.from_config(
        EngineConfig(
            model=path, device="cpu", dtype="float32", kv_cache_tokens=2048, max_batch_size=8
        )
    )
    scheduler = Scheduler(engine)
    scheduler.shutdown()  # only its limit is read here
    assert scheduler.max_running == 8
    for i in range(8):  # each takes a recurrent-state slot
        engine.add_request([1, 2, 3 + i], SamplingParams(max_new_tokens=2))
    assert len(engine.running) == 8
    while engine.running:
        engine.step()


# -- options honoured or refused by name (item 8) ---------------------------------------------


@pytest.mark.parametrize(
    ("path", "changes", "param"),
    [
        (CHAT, {"logprobs": True}, "logprobs"),
        (CHAT, {"top_logprobs": 2}, "logprobs"),
        (CHAT, {"n": 2}, "n"),
        (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
        (CHAT, {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/responses", {"text": {"format": {"type": "json_schema"}}}, "text.format"),
        ("/v1/responses", {"previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {"background": True}, "background"),
    ],
)
def test_options_that_would_change_the_answer_are_refused_by_name(server, path, changes, param):
    r = httpx.post(server[0] + path, json={**GENERATING[path](2), **changes})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"]


@pytest.mark.parametrize(
    ("path", "changes", "where"),
    [
        ("/v1/messages", {"output_config": {"format": {"type": "json_schema"}}}, "output_config"),
        ("/v1/messages", {"thinking": "yes"}, "thinking"),
        ("/v1/messages", {"system": 5}, "system"),
        ("/v1/messages", {"metadata": []}, "metadata"),
        ("/v1/responses", {"reasoning": "high"}, "reasoning"),
        ("/v1/responses", {"metadata": "m"}, "metadata"),
        (CHAT, {"metadata": 1}, "metadata"),
        # an input item's type a list (was a 500) or an object (was a reset connection)
        (
            "/v1/responses",
            {"input": [{"type": ["message"], "role": "user", "content": "x"}]},
            "input[0].type",
        ),
        (
            "/v1/responses",
            {"input": [{"type": {"a": 1}, "role": "user", "content": "x"}]},
            "input[0].type",
        ),
        (
            "/v1/responses",
            {"stream": True, "input": [{"type": {}, "content": "x"}]},
            "input[0].type",
        ),
    ],
)
def test_wrong_types_and_unsupported_formats_are_400s_naming_the_field(
    server, path, changes, where
):
    r = httpx.post(server[0] + path, json={**GENERATING[path](2), **changes})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith((where, f"'{where}"))


def test_completions_echo_and_usage_in_streams(server):
    base, _ = server
    body = {**GENERATING["/v1/completions"](3), "temperature": 0, "echo": True}
    whole = httpx.post(base + "/v1/completions", json=body).json()
    plain = httpx.post(base + "/v1/completions", json={**body, "echo": False}).json()
    assert whole["choices"][0]["text"] == "Go on" + plain["choices"][0]["text"]
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + "/v1/completions", json=streamed) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert (
        "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        == (whole["choices"][0]["text"])
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_logit_bias_and_penalties_are_honoured(server, monkeypatch):
    base, core = server
    body = {**GENERATING[CHAT](4), "temperature": 0}
    token = core.tokenizer.encode(" sea")[0]
    biased = httpx.post(base + CHAT, json={**body, "logit_bias": {str(token): 100}}).json()
    assert biased["choices"][0]["message"]["content"] == " sea" * 4
    # The penalties reach the sampler (tests/test_sampling.py checks what it does with them).
    submitted = []
    submit = core.scheduler.submit
    monkeypatch.setattr(
        core.scheduler,
        "submit",
        lambda ids, params, *a: submitted.append(params) or submit(ids, params, *a),
    )
    penalties = {"frequency_penalty": 1.5, "presence_penalty": -0.5}
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2, **penalties}
    assert httpx.post(base + "/v1/completions", json=completion).status_code == 200
    assert httpx.post(base + CHAT, json={**body, **penalties}).status_code == 200
    assert len(submitted) == 2
    for params in submitted:
        assert (params.frequency_penalty, params.presence_penalty) == (1.5, -0.5)
    r = httpx.post(base + CHAT, json={**body, "logit_bias": {"999999999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_ids_a_request_may_name_are_the_models_where_its_tokenizer_has_more(engine):
    """logit_bias ids index the model's logits: a tokenizer with more tokens than the model's
    vocabulary (a mismatched checkpoint) does not widen what a request may name."""
    from types import SimpleNamespace

    from freetoken.server.core import GenerationCore

    class Wider:  # (the engine's tokenizer, with more tokens than the model has rows)
        vocab_size = engine.runner.config.vocab_size + 100

        def __getattr__(self, name):
            return getattr(engine.tokenizer, name)

    core = GenerationCore(SimpleNamespace(engine=engine), Wider(), MODEL)
    assert core.vocab_size == engine.runner.config.vocab_size


def test_a_long_model_name_is_not_echoed_whole(server):
    r = httpx.post(server[0] + CHAT, json={**GENERATING[CHAT](2), "model": "m" * 2**20})
    assert r.status_code == 404 and len(r.content) < 1000


def test_a_full_queue_says_when_to_retry(fresh_engine):
    with running_server(fresh_engine, MODEL, max_queued=0) as (base, _):
        r = httpx.post(base + CHAT, json=GENERATING[CHAT](2))
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
        anthropic = httpx.post(base + "/v1/messages", json=GENERATING["/v1/messages"](2))
        assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == (
            "rate_limit_error"
        )


# -- stats (item 9) and metrics ----------------------------------------------------------------


def test_prefill_counts_are_the_tokens_the_engine_prefilled(engine):
    """Two prompts longer than the step's prefill cap, prefilled together: /v1/stats counts
    each prompt token once (it counted the per-request split, not the capped step's)."""
    from server_fixtures import demo_engine

    engine = demo_engine(max_prefill_chunk=48)
    with running_server(engine, MODEL) as (base, _):
        prompts = [f"{i} " + "the tide comes in and goes out " * 12 for i in range(2)]
        before = httpx.get(base + "/v1/stats").json()
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0}
        threads = [
            in_background(
                lambda p=p: httpx.post(
                    base + "/v1/completions", timeout=60, json={**body, "prompt": p}
                )
            )
            for p in prompts
        ]
        for _, done, result in threads:
            assert done.wait(60) and result["value"].status_code == 200
        after = httpx.get(base + "/v1/stats").json()
    recomputed = after["prefix_reuse"]["recomputed_tokens"]
    recomputed -= before["prefix_reuse"]["recomputed_tokens"]
    total = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert total > 2 * 48
    assert after["tokens"]["prefill"] - before["tokens"]["prefill"] == recomputed <= total


def test_metrics_are_prometheus_histograms(server):
    base, _ = server
    httpx.post(base + CHAT, json={**GENERATING[CHAT](3), "temperature": 0})
    text = httpx.get(base + "/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_duration_seconds",
    ):
        family = families[f"freetoken_{name}"]
        assert family.type == "histogram"
        count = next(s.value for s in family.samples if s.name.endswith("_count"))
        assert count >= 1
    assert families["freetoken_decode_tokens"].type == "counter"
    assert families["freetoken_kv_pages_free"].type == "gauge"


def test_engine_failures_end_streams_with_the_apis_error_event(fresh_engine):
    """A step that raises: each API's stream ends with its own error event, a whole answer
    is a 500 in the API's shape, and the next request is served."""
    with running_server(fresh_engine, MODEL) as (base, _):
        real = fresh_engine.step
        fresh_engine.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
        try:
            with httpx.stream(
                "POST", base + CHAT, json={**GENERATING[CHAT](4), "stream": True}
            ) as r:
                chat = [x for x in r.iter_lines() if x.startswith("data: ")]
            with httpx.stream(
                "POST",
                base + "/v1/messages",
                json={**GENERATING["/v1/messages"](4), "stream": True},
            ) as r:
                anthropic = [x for x in r.iter_lines() if x.startswith(("event: ", "data: "))]
            with httpx.stream(
                "POST",
                base + "/v1/responses",
                json={**GENERATING["/v1/responses"](4), "stream": True},
            ) as r:
                responses = [x for x in r.iter_lines() if x.startswith("data: ")]
            whole = httpx.post(base + "/v1/messages", json=GENERATING["/v1/messages"](4))
        finally:
            fresh_engine.step = real
        assert chat[-1] == "data: [DONE]" and "boom" in json.loads(chat[-2][6:])["error"]["message"]
        assert anthropic[-2] == "event: error"
        assert json.loads(anthropic[-1][6:])["error"]["type"] == "api_error"
        final = json.loads(responses[-1][6:])
        assert (
            final["type"] == "response.failed" and "boom" in final["response"]["error"]["message"]
        )
        assert whole.status_code == 500 and whole.json()["type"] == "error"
        ok = httpx.post(base + CHAT, json=GENERATING[CHAT](2))
        assert ok.status_code == 200


def test_docs_list_the_server_flags():
    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    for flag in (
        "--max-request-bytes",
        "--allow-request-chat-template",
        "--template-timeout",
        "--shutdown-timeout",
    ):
        assert flag in text, flag
