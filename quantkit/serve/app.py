"""The OpenAI-compatible HTTP API over the engine (a Starlette app; `serve.server` runs it with uvicorn).

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the model's
chat template), GET /metrics (Prometheus text). `stream: true` answers server-sent events, one
`data: {chunk}` per piece of text, the finish, the usage when `stream_options.include_usage`, then
`data: [DONE]`. A bad request is answered 400 with OpenAI's error body naming the field; too many
waiting requests 503 at once; a client that goes away (mid-stream or while waiting for a whole
answer) has its request aborted, so its KV blocks go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from quantkit.engine.engine import Finished
from quantkit.engine.loop import Busy, Draining, EngineLoop
from quantkit.errors import ContextLengthError, KVCapacityError
from quantkit.runtime.chat import NoChatTemplateError, chat_prompt_ids
from quantkit.serve import protocol
from quantkit.serve.protocol import BadRequest, Parsed

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: object  # the server thread's own copy (fast tokenizers are not shared across threads)
    model_name: str
    started: int


def _error(message: str, status: int = 400, param: Optional[str] = None, kind: str = "invalid_request_error",
           code: Optional[str] = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, param, kind, code), status_code=status)


async def _body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def _prompt_ids(state: ServerState, parsed: Parsed) -> list[int]:
    if parsed.messages is not None:
        try:
            return chat_prompt_ids(state.tokenizer, parsed.messages)
        except NoChatTemplateError:
            raise BadRequest("this model has no chat template; use /v1/completions", "messages") from None
        except Exception as exc:  # a template that refuses these messages (e.g. roles out of order)
            raise BadRequest(f"the chat template refused these messages: {exc}", "messages") from None
    if isinstance(parsed.prompt, list):
        vocab = len(state.tokenizer)
        if max(parsed.prompt) >= vocab:
            raise BadRequest(f"'prompt' has token id {max(parsed.prompt)}, beyond the vocabulary of {vocab}", "prompt")
        return parsed.prompt
    return list(state.tokenizer(parsed.prompt)["input_ids"])


def _max_tokens(state: ServerState, parsed: Parsed, prompt_len: int) -> int:
    engine = state.loop.engine
    field = "messages" if parsed.messages is not None else "prompt"
    cap = min(engine.limit, engine.capacity_tokens)
    if parsed.max_tokens is None:
        if prompt_len >= cap:
            raise BadRequest(f"the prompt has {prompt_len} tokens, leaving no room in the model's context of "
                             f"{engine.limit} tokens (KV pool: {engine.capacity_tokens})", field)
        return cap - prompt_len
    try:
        engine.check_fits(prompt_len, parsed.max_tokens)
    except (ContextLengthError, KVCapacityError) as exc:
        raise BadRequest(str(exc), field if prompt_len >= cap else "max_tokens") from None
    return parsed.max_tokens


def _completion_tokens(f: Finished) -> int:
    """Tokens generated, the end token that stopped it included."""
    return len(f.completion.token_ids) + (1 if isinstance(f.completion.stop_reason, int) else 0)


def _usage(f: Finished) -> dict:
    return protocol.usage(f.completion.prompt_tokens, _completion_tokens(f), f.seq.cached_prompt_tokens)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _whole(state: ServerState, request: Request, rid: str, events: asyncio.Queue, parsed: Parsed, chat: bool):
    """Wait for the whole answer; abort the request if the client goes away first."""
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        while True:
            get = asyncio.ensure_future(events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                state.loop.abort(rid)
                return Response(status_code=499)
            kind, payload = get.result()
            if kind == "error":
                return _error(payload, 500, kind="server_error")
            if kind == "done":
                if payload.error:
                    return _error(f"generation failed: {payload.error}", 500, kind="server_error")
                make = protocol.chat_body if chat else protocol.completion_body
                return JSONResponse(make(rid, state.model_name, payload.completion.text, payload.reason, _usage(payload)))
    finally:
        gone.cancel()


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(state: ServerState, rid: str, events: asyncio.Queue, parsed: Parsed, chat: bool):
    name, ended = state.model_name, False
    try:
        if chat:
            yield _sse(protocol.chunk(rid, name, True, "", None, first=True))
        while True:
            kind, payload = await events.get()
            if kind == "text":
                yield _sse(protocol.chunk(rid, name, chat, payload, None))
                continue
            ended = True
            if kind == "error" or payload.error:
                yield _sse(protocol.error_body(f"generation failed: {payload if kind == 'error' else payload.error}",
                                               kind="server_error"))
            else:
                yield _sse(protocol.chunk(rid, name, chat, None, payload.reason))
                if parsed.include_usage:
                    yield _sse(protocol.chunk(rid, name, chat, None, None, use=_usage(payload)))
            yield "data: [DONE]\n\n"
            return
    finally:
        if not ended:  # the client went away (the response task was cancelled) or the server is stopping
            state.loop.abort(rid)


async def _generate(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.quantkit
    try:
        body = await _body(request)
        parsed = protocol.parse_chat(body) if chat else protocol.parse_completion(body)
        if parsed.model != state.model_name:
            raise BadRequest(f"model {parsed.model!r} is not served here; this server serves {state.model_name!r}",
                             "model", kind="invalid_request_error")
        ids = _prompt_ids(state, parsed)
        params = protocol.sampling_params(parsed, _max_tokens(state, parsed, len(ids)))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        events = state.loop.submit(rid, ids, params, asyncio.get_running_loop())
    except BadRequest as exc:
        return _error(exc.message, exc.status, exc.param, exc.kind)
    except Busy as exc:
        return _error(str(exc), 503, kind="server_busy", code="too_many_waiting")
    except Draining as exc:
        return _error(str(exc), 503, kind="server_shutting_down")
    if parsed.stream:
        return StreamingResponse(_stream(state, rid, events, parsed, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(state, request, rid, events, parsed, chat)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.quantkit
    return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.started,
                                                     "owned_by": "quantkit", "max_model_len": state.loop.engine.limit}]})


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.quantkit
    if state.loop.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if state.loop.failed:
        return JSONResponse({"status": "degraded", "last_error": state.loop.failed})
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.quantkit
    engine = state.loop.engine
    gauges = engine.gauges()
    gauges["requests_waiting"] = (gauges["requests_waiting"][0], state.loop.waiting)
    return PlainTextResponse(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code, kind=kind)


def build_app(loop: EngineLoop, tokenizer, model_name: str, on_shutdown=None) -> Starlette:
    """The app; `on_shutdown()` runs when the server stops (after the open connections closed or timed out)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = Starlette(lifespan=lifespan, routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error})
    app.state.quantkit = ServerState(loop, copy.deepcopy(tokenizer), model_name, int(time.time()))
    return app
