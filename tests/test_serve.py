"""``viasd-tune serve`` (issue 34) against a live server on loopback, driven by the official ``openai`` client:
chat and text completions, streamed and not, concurrency, client disconnects and bad requests. Every request
has a timeout and the client never retries."""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
import torch
from serve_helpers import CHARS, CONTEXT, DECODE_FLAGS, Server, save_models

from viasd_tune import models
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet

TIMEOUT_S = 120  # per request: generous for a busy machine, small against a hang
# The server's DECODE_FLAGS as a configuration, for the in-process reference.
CONFIG = DecodeConfig(
    mode="viasd",
    drafter="model",
    gamma=4,
    skip=SkipSet.of([1], [2]),
    tau_accept=0.05,
    tau_escalate=3.0,
    recheck=True,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    target, draft = model_dirs
    srv = Server(
        ["--model", target, "--draft", draft, *DECODE_FLAGS], tmp_path_factory.mktemp("log") / "a.log"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model_dirs):
    """What a sequential ``generate`` gives, in this process, on the same models and configuration."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the server runs one thread too: same kernels, same sums, same greedy tokens
    target, draft = (models.load(p, "float32", "cpu") for p in model_dirs)
    yield Decoder(target.model, target.tokenizer, CONFIG, draft=draft.model)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def _model(server) -> str:
    return server.health()["model"]


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(CHARS, k=rng.randint(5, 30))) for _ in range(n)]


def _chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [_model(server)]
    assert client.models.retrieve(_model(server)).id == _model(server)
    assert server.health() == {
        "status": "ok",
        "model": _model(server),
        "running": 0,
        "queued": 0,
        "max_queue": 16,
    }


def test_chat_streamed_equals_whole_and_generate(server, client, reference) -> None:
    for text in _prompts(3, seed=1):
        whole = client.chat.completions.create(
            model=_model(server), messages=_chat(text), max_tokens=24, temperature=0
        )
        chunks = list(
            client.chat.completions.create(
                model=_model(server),
                messages=_chat(text),
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        ref = reference.generate(_chat(text), max_new_tokens=24)
        assert whole.choices[0].message.content == "".join(pieces) == ref.text
        assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
        assert len(pieces) > 1  # it streams round by round
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finish] == ["length"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == len(
            reference.prompt_ids(_chat(text))
        )
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
        # the decoder's stats: tier shares and tokens per full-target call, streamed on the finish chunk too
        for stats in (whole.model_extra["viasd"], finish[0].model_extra["viasd"]):
            assert stats["new_tokens"] == 24 and sum(stats["tier_shares"].values()) == pytest.approx(1.0)
            assert stats["tokens_per_full_call"] == pytest.approx(24 / stats["full_calls"])


def test_completion_streamed_equals_whole_and_generate(server, client, reference) -> None:
    for text in _prompts(3, seed=2):
        whole = client.completions.create(model=_model(server), prompt=text, max_tokens=20, temperature=0)
        chunks = list(
            client.completions.create(
                model=_model(server), prompt=text, max_tokens=20, temperature=0, stream=True
            )
        )
        pieces = [c.choices[0].text for c in chunks]
        ref = reference.generate(text, max_new_tokens=20, chat="off")
        assert whole.choices[0].text == "".join(pieces) == ref.text
        assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert whole.usage.prompt_tokens == len(reference.prompt_ids(text, chat="off"))


def test_defaults_stop_strings_and_sampling(server, client, reference) -> None:
    text = _prompts(1, seed=3)[0]
    ref = reference.generate(text, max_new_tokens=16, chat="off")
    default = client.completions.create(model=_model(server), prompt=text, temperature=0)
    assert default.choices[0].text == ref.text and default.usage.completion_tokens == 16  # the API's default
    stop = ref.text[6:8]
    cut = ref.text[: ref.text.index(stop)]
    whole = client.completions.create(model=_model(server), prompt=text, temperature=0, stop=[stop, "@@"])
    streamed = client.completions.create(
        model=_model(server), prompt=text, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == cut
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    kw = dict(model=_model(server), prompt=text, max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b == reference.generate(text, 12, 1.0, 0.9, 7, chat="off").text  # sampling is seeded


def test_eight_concurrent_clients_get_their_own_answers(server, reference) -> None:
    """8 clients at once (batch 1: they queue) each get exactly what a sequential generate gives them."""
    answers: dict[str, str] = {}  # 8 prompts with distinct answers, so a mix-up would show
    for t in _prompts(40, seed=4):
        answers.setdefault(reference.generate(_chat(t), max_new_tokens=20).text, t)
        if len(answers) == 8:
            break
    want, texts = list(answers), list(answers.values())
    assert len(want) == 8

    def ask(i: int) -> str:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        kw = dict(model=_model(server), messages=_chat(texts[i]), max_tokens=20, temperature=0)
        if i % 2:
            return "".join(
                ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)
            )
        return c.chat.completions.create(**kw).choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == want
    assert server.health()["running"] == 0 and server.health()["queued"] == 0


def _stopped_generations(server) -> list[int]:
    return [int(n) for n in re.findall(r"client gone; generation stopped after (\d+) tokens", server.log())]


def _wait_stopped(server, before: int) -> list[int]:
    """Wait until the server has logged one more generation stopped by a client gone (and is idle again)."""
    server.wait_health(lambda h: h["running"] == 0, timeout_s=TIMEOUT_S)
    deadline = time.monotonic() + 30
    while len(_stopped_generations(server)) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    return _stopped_generations(server)


def test_a_disconnect_frees_the_model(server, client) -> None:
    """A client that drops a long answer, streamed or not, stops its generation within a round (long before
    its max_tokens); the next request is served."""
    body = {
        "model": _model(server),
        "messages": _chat("tell me everything"),
        "max_tokens": CONTEXT - 64,
        "temperature": 0,
        "stream": True,
    }
    before = len(_stopped_generations(server))
    with (
        httpx.Client(timeout=TIMEOUT_S) as http,
        http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():  # read until some text has come, then hang up mid-stream
            if line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get("content"):
                break
    stopped = _wait_stopped(server, before)
    assert len(stopped) == before + 1 and 0 < stopped[-1] < CONTEXT - 64
    # not streamed: a client that gives up waiting (its read timeout) hangs up as well
    server.wait_health(lambda h: h["running"] == 0 and h["queued"] == 0, timeout_s=TIMEOUT_S)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=3)
    stopped = _wait_stopped(server, before + 1)
    assert len(stopped) == before + 2 and stopped[-1] < CONTEXT - 64
    out = client.completions.create(model=_model(server), prompt="next", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5


def _post(server, path: str, content: str | bytes, headers: dict | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=h, timeout=TIMEOUT_S)


def _bad_requests(model: str) -> list[tuple[str, str, int, str]]:
    """(path, body, status, what the error message says) for each bad request the issue lists, and a few more."""
    chat = "/v1/chat/completions"
    ok = {"model": model, "messages": [{"role": "user", "content": "hi"}]}

    def body(**changes) -> str:
        return json.dumps({**ok, **changes})

    long_prompt = "a" * (CONTEXT + 10)
    return [
        (chat, '{"model": "x", "messages": [', 400, "not valid JSON"),
        (chat, "[1, 2]", 400, "valid dictionary"),
        (chat, body(model="gpt-9"), 404, "does not exist"),
        (chat, body(max_tokens=0), 400, "max_tokens must be at least 1"),
        (chat, body(max_tokens=-5), 400, "max_tokens must be at least 1"),
        (chat, body(max_tokens=CONTEXT), 400, "exceed the model's context"),
        (chat, body(temperature=-0.5), 400, "temperature must be >= 0"),
        (chat, body(max_tokens="ten"), 400, "max_tokens"),
        (chat, body(temperature="hot"), 400, "temperature"),
        (chat, body(stop=7), 400, "stop"),
        (chat, body(stream="yes"), 400, "stream"),
        (chat, body(messages="hi"), 400, "messages"),
        (chat, body(messages=[]), 400, "messages"),
        (chat, body(messages=[{"role": "user", "content": long_prompt}]), 400, "shorten it"),
        (chat, body(n=3), 400, "n is not supported"),
        (chat, body(logprobs=True), 400, "logprobs is not supported"),
        (chat, body(top_p=0), 400, "top_p"),
        (chat, body(seed=-1), 400, "seed"),
        (chat, body(stop=["a", "b", "c", "d", "e"]), 400, "at most 4"),
        ("/v1/completions", json.dumps({"model": model, "prompt": long_prompt}), 400, "shorten it"),
        ("/v1/completions", json.dumps({"model": model, "prompt": [10**9]}), 400, "vocabulary"),
        ("/v1/completions", json.dumps({"model": model}), 400, "prompt"),
        ("/v1/nowhere", "{}", 404, "Not Found"),
    ]


def test_bad_requests_get_openai_errors_and_the_server_lives_on(server, client) -> None:
    for path, content, status, needle in _bad_requests(_model(server)):
        r = _post(server, path, content)
        assert r.status_code == status, (content, r.text)
        err = r.json()["error"]
        assert needle in err["message"], (content, err)
        assert set(err) == {"message", "type", "param", "code"}
        assert server.health()["status"] == "ok"
    # the official client raises its typed errors for them
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=_model(server), prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=_chat("x"))
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=_model(server), messages=_chat("x"), max_tokens=10 * CONTEXT)
    # unknown fields the SDKs send are ignored
    out = client.chat.completions.create(
        model=_model(server),
        messages=_chat("x"),
        max_tokens=3,
        temperature=0,
        top_p=0.5,  # ignored when greedy, as OpenAI does (the CLI and Python API refuse them there)
        seed=5,
        user="u1",
        extra_body={"foo": 1},
    )
    assert out.usage.completion_tokens == 3
    assert "Traceback" not in server.log()
