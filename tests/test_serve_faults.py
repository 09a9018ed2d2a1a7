"""``viasd-tune serve`` under faults (issue 34): API keys, a full queue, SIGTERM while requests are in flight.
A live server on loopback, the official ``openai`` client; every request bounded in time, no retries."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx
import openai
import pytest
from serve_helpers import CONTEXT, DECODE_FLAGS, Server, save_models

TIMEOUT_S = 120
KEY = "sk-test-8c1f0d5e9a7b4c3d"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="module")
def keyed(model_dirs, tmp_path_factory):
    """A server with an API key and room for one waiting request."""
    target, draft = model_dirs
    args = ["--model", target, "--draft", draft, *DECODE_FLAGS, "--api-key", KEY, "--max-queue", "1"]
    srv = Server(args, tmp_path_factory.mktemp("log") / "keyed.log")
    yield srv
    srv.stop()


def _client(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def _chat_body(model: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "write a long story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def _first_text(lines) -> None:
    """Read a streamed chat answer's lines until its first text: the request holds the model. The caller keeps
    ``lines`` (``response.iter_lines()``) alive: dropping that iterator closes the connection."""
    for line in lines:
        if line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get("content"):
            return
    raise AssertionError("the stream ended before any text")


def test_api_key_is_required_and_never_logged(keyed) -> None:
    model = keyed.health()["model"]  # /health stays open: load balancers probe it without a key
    assert _client(keyed).models.list().data[0].id == model
    wrong = "sk-wrong-3f9e2a71b6d04c58"
    with pytest.raises(openai.AuthenticationError) as e:
        _client(keyed, wrong).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for headers in (
        {},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
        {"Authorization": KEY},
    ):
        r = httpx.post(
            f"{keyed.url}/v1/completions",
            json={"model": model, "prompt": "hi", "max_tokens": 2},
            headers=headers,
            timeout=TIMEOUT_S,
        )
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
    # before the body is even read: an unauthenticated client learns nothing about it
    r = httpx.post(f"{keyed.url}/v1/completions", content="{not json", timeout=TIMEOUT_S)
    assert r.status_code == 401
    out = _client(keyed).completions.create(model=model, prompt="hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    log = keyed.log()
    assert "POST /v1/completions" in log  # the log has the requests...
    assert KEY not in log and wrong not in log  # ...but never a key


def test_full_queue_answers_429_with_retry_after(keyed) -> None:
    model = keyed.health()["model"]
    queued: list = []
    with (
        httpx.Client(timeout=TIMEOUT_S, headers={"Authorization": f"Bearer {KEY}"}) as http,
        http.stream(
            "POST", f"{keyed.url}/v1/chat/completions", json=_chat_body(model, CONTEXT - 64, True)
        ) as running,
    ):
        lines = running.iter_lines()
        _first_text(lines)  # one generating...
        waiter = threading.Thread(
            target=lambda: queued.append(
                _client(keyed).completions.create(model=model, prompt="wait", max_tokens=4, temperature=0)
            )
        )
        waiter.start()  # ...one waiting (--max-queue 1)...
        keyed.wait_health(lambda h: h["running"] == 1 and h["queued"] == 1, timeout_s=TIMEOUT_S)
        with pytest.raises(openai.RateLimitError) as e:  # ...so the next is turned away
            _client(keyed).completions.create(model=model, prompt="one more", max_tokens=4)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert int(e.value.response.headers["retry-after"]) >= 1
        r = http.post(f"{keyed.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert keyed.health()["status"] == "ok"
    # the running client hung up: the waiting request gets the model and its answer
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive() and queued[0].usage.completion_tokens == 4
    keyed.wait_health(lambda h: h["running"] == 0 and h["queued"] == 0, timeout_s=TIMEOUT_S)


def test_sigterm_drains_in_flight_requests_then_exits_0(model_dirs, tmp_path) -> None:
    """SIGTERM while one request streams and another waits: both are answered in full, then the server exits 0."""
    target, draft = model_dirs
    server = Server(["--model", target, "--draft", draft, *DECODE_FLAGS], tmp_path / "drain.log")
    queued: list = []
    try:
        model = server.health()["model"]
        waiter = threading.Thread(
            target=lambda: queued.append(
                _client(server, "none").completions.create(
                    model=model, prompt="queued", max_tokens=5, temperature=0
                )
            )
        )
        with (
            httpx.Client(timeout=TIMEOUT_S) as http,
            http.stream("POST", f"{server.url}/v1/chat/completions", json=_chat_body(model, 60, True)) as r,
        ):
            lines = r.iter_lines()
            _first_text(lines)
            waiter.start()
            server.wait_health(lambda h: h["queued"] == 1, timeout_s=TIMEOUT_S)
            server.terminate()
            data = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert server.proc.wait(TIMEOUT_S) == 0, server.log()
        waiter.join(TIMEOUT_S)
    finally:
        server.stop()
    # the stream ran to its end: every token, the finish reason, then [DONE]
    assert data[-1] == "[DONE]"
    finish = json.loads(data[-2])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["viasd"]["new_tokens"] == 60
    assert queued and queued[0].usage.completion_tokens == 5  # the waiting request was answered too
    assert "Shutting down" in server.log()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--port", "70000"], "--port must be from 0 to 65535"),
        (["--max-queue", "-1"], "--max-queue must be 0 or more"),
        (["--api-key", " "], "API key"),
        (["--profile", "p.json", "--gamma", "3"], "--gamma cannot be combined with --profile"),
        # issue 31: the same flag table, finite floats and --strict-host rule as generate
        (["--mode", "sd", "--recheck"], "recheck (--recheck) applies to mode viasd only"),
        (["--mode", "sd", "--drafter", "lookup", "--lookup-min", "5"], "applies to drafter lookup+model"),
        (["--mode", "ar", "--draft", "/no/such/draft"], "--draft does nothing in mode ar"),
        (["--strict-host"], "--strict-host does nothing without --profile"),
        (["--tau-accept", "nan"], "argument --tau-accept: 'nan' is not a finite number"),
    ],
)
def test_bad_serve_flags_fail_in_one_line_before_loading(capsys, extra, needle) -> None:
    from viasd_tune.cli import main

    try:
        rc = main(["serve", "--model", "/no/such/model", *extra])
    except SystemExit as e:  # refused while the flags are parsed
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_taken_port_fails_before_loading(capsys) -> None:
    import socket

    from viasd_tune.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1
