"""The OpenAI-compatible HTTP API over one loaded decoder: FastAPI on uvicorn, server-sent events by sse-starlette.

Batch 1: one generation runs at a time on the model (its torch work in its own thread, so the event loop keeps
answering); up to ``max_queue`` requests wait in FIFO order and the next one gets 429 with Retry-After. A
request leaves the model only once its generation thread has stopped, so two never share it. A client that
disconnects stops its generation at the end of the current round.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import math
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..decoding.common import TIERS, Stats
from ..decoding.streaming import StreamEnd, TextStream, check_stop
from ..errors import UserError
from ..models import context_length
from ..prompts import encode_messages, encode_prompt
from .api import APIError, ChatRequest, CompletionRequest

log = logging.getLogger(__name__)
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI API's default max_tokens for /v1/completions
SEND_TIMEOUT_S = (
    60  # a streaming client that reads nothing for this long is dropped (it would hold the model)
)


class Worker:
    """The model's one generation slot (batch 1) and the bounded FIFO queue in front of it."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.lock = asyncio.Lock()  # FIFO: waiters acquire in arrival order
        self.waiting = 0
        self.seconds = 2.0  # running mean of a request's time on the model, for Retry-After

    def retry_after(self) -> int:
        return max(1, math.ceil(self.seconds * (self.waiting + 1)))

    async def acquire(self) -> None:
        """Wait for the slot; when ``max_queue`` requests already wait, answer 429 instead."""
        if (self.lock.locked() or self.waiting) and self.waiting >= self.max_queue:
            retry = self.retry_after()
            raise APIError(
                429,
                f"the server is busy: one request is generating and {self.waiting} are waiting (--max-queue "
                f"{self.max_queue}); retry after {retry} s",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            )
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1


class Generation:
    """One request's turn on the model: its :class:`TextStream`, iterated without blocking the event loop.
    ``close()`` (idempotent, safe under cancellation) stops it within a round, waits for its thread and hands
    the model to the next request."""

    def __init__(self, worker: Worker, stream: TextStream, rid: str):
        self.worker, self.stream, self.rid = worker, stream, rid
        self.start, self.closed = time.monotonic(), False

    async def items(self) -> AsyncIterator[str | StreamEnd]:
        while True:
            # abandon_on_cancel: a client gone mid-wait is noticed now; close() then stops the generation
            item = await anyio.to_thread.run_sync(next, self.stream, None, abandon_on_cancel=True)
            if item is None:
                return
            yield item

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stream.cancel()  # a no-op once it has ended
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stream.close)
        end = self.stream.end
        if end is not None and end.finish_reason == "cancelled":
            log.info(
                "%s: client gone; generation stopped after %d tokens", self.rid, len(end.result.token_ids)
            )
        seconds = time.monotonic() - self.start
        self.worker.seconds = 0.8 * self.worker.seconds + 0.2 * seconds
        self.worker.lock.release()


class _SlotEventSource(EventSourceResponse):
    """An SSE response that holds the model until it is sent or abandoned, even if its body never started."""

    def __init__(self, content: AsyncIterator[str], generation: Generation):
        super().__init__(content, send_timeout=SEND_TIMEOUT_S)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()


class _BearerAuth:
    """ASGI middleware: every /v1 route needs ``Authorization: Bearer <key>``, compared in constant time. It runs
    before the body is read, so an unauthenticated client learns nothing else. The key is never logged."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                error = APIError(
                    401,
                    "missing or wrong API key; send the header 'Authorization: Bearer <key>' with the server's key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Reply:
    """The response objects of one request, chat or text completion, streamed or whole."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int):
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, obj: str, choice: dict) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return self._envelope("text_completion", choice)
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", choice)

    def usage(self, end: StreamEnd) -> dict:
        n = len(end.result.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
        }

    def whole(self, end: StreamEnd) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": end.result.text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": end.finish_reason}
            out = self._envelope("chat.completion", choice)
        else:
            out = self.chunk(end.result.text, end.finish_reason)
        return {**out, "usage": self.usage(end), "viasd": decoder_stats(end.result.stats)}


def decoder_stats(stats: Stats) -> dict:
    """The response's ``viasd`` extension: the decoder's counts, tier shares and tokens per full-target call."""
    n = stats.new_tokens
    shares = {t: (getattr(stats, f"tokens_{t}") / n if n else 0.0) for t in TIERS}
    return {**stats.to_dict(), "tier_shares": shares}


def _finish_reason(end: StreamEnd) -> str:
    return "length" if end.finish_reason == "length" else "stop"


def create_app(decoder, model_name: str, api_key: str | None = None, max_queue: int = 16) -> FastAPI:
    """The API over ``decoder`` (a :class:`Decoder` or a routed one), answering as ``model_name``."""
    single = decoder.decoders[0] if hasattr(decoder, "decoders") else decoder
    ctx = context_length(single.target)
    # Encoding runs on the event loop while a generation decodes text in its thread; a Rust tokenizer refuses
    # such concurrent use ("Already borrowed"), so requests are encoded with a copy of their own.
    tokenizer = copy.deepcopy(decoder.tokenizer)
    worker = Worker(max_queue)
    started = int(time.time())
    app = FastAPI(title="viasd-tune", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(_BearerAuth, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})"
            return APIError(400, message + "; send one JSON object").response()
        param = ".".join(loc) or None
        where = f"{param}: " if param else ""
        return APIError(400, f"{where}{err.get('msg', 'invalid value')}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = f"{e.detail}: {request.method} {request.url.path}"
        return APIError(e.status_code, message, code=None).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s %s failed", request.method, request.url.path)
        return APIError(
            500, f"internal error ({type(e).__name__}); see the server's log", "server_error"
        ).response()

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": model_name,
            "running": int(worker.lock.locked()),
            "queued": worker.waiting,
            "max_queue": worker.max_queue,
        }

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "viasd-tune"}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        check_model(name)
        return model_card()

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{model_name}' (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def settings(req, prompt_tokens: int, max_tokens: int | None, default: int, prompt_param: str) -> dict:
        """The request's decoding settings, checked against the model's context before it waits for a turn."""
        if prompt_tokens >= ctx:
            raise APIError(
                400,
                f"the prompt has {prompt_tokens} tokens; the model's context is {ctx} tokens; shorten it",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = default if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1 (got {max_tokens})", param="max_tokens")
        if prompt_tokens + max_tokens > ctx:
            raise APIError(
                400,
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} exceed the model's context of "
                f"{ctx} tokens; ask for at most {ctx - prompt_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise APIError(
                400, f"temperature must be >= 0 (got {temperature}); 0 is greedy", param="temperature"
            )
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if not 0 < top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
        if req.seed is not None and not 0 <= req.seed < 2**63:
            raise APIError(400, f"seed must be from 0 to 2**63 - 1 (got {req.seed})", param="seed")
        try:
            stop = check_stop(req.stop)
        except UserError as e:
            raise APIError(400, str(e), param="stop") from None
        seed = req.seed
        if temperature == 0:
            # OpenAI's API takes top_p and seed with greedy decoding and ignores them, and SDKs send them by
            # default; the decoder refuses what does nothing (config.check_generation), so they are dropped here.
            top_p, seed = 1.0, None
        out = dict(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop)
        if hasattr(decoder, "decoders"):  # a routed profile's rule may read the task category
            out["category"] = req.category
        return out

    async def answer(request: Request, req, chat: bool, ids: list[int], kwargs: dict) -> Response:
        reply = _Reply(chat, model_name, len(ids))
        await worker.acquire()
        try:
            stream = decoder.stream(ids, **kwargs)
        except UserError as e:
            worker.lock.release()
            raise APIError(400, str(e)) from None
        except BaseException:
            worker.lock.release()
            raise
        generation = Generation(worker, stream, reply.id)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _SlotEventSource(_events(generation, reply, usage), generation)
        try:
            end = await _until_done_or_gone(request, generation)
        finally:
            await generation.close()
        if end is None:  # the client left; nobody reads this
            return Response(status_code=499)
        _log_done(reply, end, generation)
        return JSONResponse(reply.whole(end))

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a batch of one text
            prompt = prompt[0]
        try:
            ids = (
                encode_prompt(tokenizer, prompt, "off")
                if isinstance(prompt, str)
                else single.prompt_ids(prompt)
            )
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from None
        kwargs = settings(req, len(ids), req.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt")
        return await answer(request, req, False, ids, kwargs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest) -> Response:
        check_model(req.model)
        try:
            ids = encode_messages(tokenizer, [m.as_template_input() for m in req.messages])
        except UserError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # a template that rejects this conversation (roles out of order, ...)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        if not ids:
            raise APIError(400, "the messages encode to no tokens; send some text", param="messages")
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        kwargs = settings(req, len(ids), limit, ctx - len(ids), "messages")
        return await answer(request, req, True, ids, kwargs)

    return app


async def _until_done_or_gone(request: Request, generation: Generation) -> StreamEnd | None:
    """Run a whole (not streamed) generation; None if the client disconnected first (which stops it)."""
    end: StreamEnd | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        async for item in generation.items():
            if isinstance(item, StreamEnd):
                end = item
        tg.cancel_scope.cancel()
    return end


async def _events(generation: Generation, reply: _Reply, usage: bool) -> AsyncIterator[str]:
    """The SSE data of a streamed answer: chunks, the last with the finish reason and the decoder's stats, the
    usage chunk if asked for, then ``[DONE]``. A failure mid-stream becomes an error event (the status is sent)."""
    try:
        if reply.chat:
            yield json.dumps(reply.chunk(first=True))
        async for item in generation.items():
            if isinstance(item, StreamEnd):
                last = reply.chunk(finish=_finish_reason(item))
                yield json.dumps({**last, "viasd": decoder_stats(item.result.stats)})
                if usage:
                    yield json.dumps({**last, "choices": [], "usage": reply.usage(item)})
                _log_done(reply, item, generation)
            else:
                yield json.dumps(reply.chunk(item))
        yield "[DONE]"
    except Exception as e:
        log.exception("%s failed mid-stream", reply.id)
        yield json.dumps(
            APIError(500, f"internal error ({type(e).__name__}); see the server's log", "server_error").body()
        )
    finally:
        await generation.close()


def _log_done(reply: _Reply, end: StreamEnd, generation: Generation) -> None:
    log.info(
        "%s: %d prompt + %d new tokens, %s, %.2f s",
        reply.id,
        reply.prompt_tokens,
        len(end.result.token_ids),
        end.finish_reason,
        time.monotonic() - generation.start,
    )


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound here so a taken port is one clear error and ``--port 0`` works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host"
        ) from None
    return sock


def run(app: FastAPI, sock: socket.socket) -> None:
    """Serve on ``sock`` until SIGTERM or Ctrl-C. SIGTERM drains: no new connections, every request already in
    (generating or queued) is answered, then this returns (exit 0)."""
    import uvicorn
    from sse_starlette.sse import AppStatus

    # sse-starlette would end every open stream on shutdown; ours are bounded by max_tokens, so let them finish.
    AppStatus.disable_automatic_graceful_drain()
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=None))
    # uvicorn re-raises the signal it drained on once it has shut down, which would end the process with 143;
    # this handler (the one uvicorn restores) makes that a normal return. A SIGTERM arriving before uvicorn
    # installs its own handler stops the server the same way.
    previous = signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
