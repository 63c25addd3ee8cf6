"""OpenAI-compatible HTTP server around an `InferenceModel` (FastAPI + uvicorn): the routes and
server-sent events. The request schema is in schema.py, the batcher in batcher.py, image loading
in images.py, the settings in config.py.

    vlm = InferenceModel.load("merged/", quant=QuantConfig.from_flag("nf4"))
    app = create_app(vlm, ServeConfig(allow_files="/data/images", max_batch=8))
    serve(app, host="127.0.0.1", port=8000)               # what `vlforge serve` does (uvicorn)

Endpoints: `POST /v1/chat/completions` (OpenAI's chat completions shape, `stream: true` for
server-sent events), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text format,
metrics.py). Every error is a 4xx/5xx in OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`, and the server keeps serving. With `cfg.api_key` set, every route but /health needs
`Authorization: Bearer KEY` (401 without it).

A handler validates a request in a worker thread, off the event loop (JSON parsed, prompt length
bounded, images decoded, tokens counted), puts it on the batcher's queue and awaits its events.
A client that disconnects cancels its request: it is skipped if its batch has not started, or its
row stops at the next token.

Shutdown drains (`serve` runs uvicorn's server with `DrainingServer`): while it still listens, new
requests get 503 (`shutting_down`) and /health 503 `{"status": "draining"}`, the accepted requests
finish for up to `cfg.drain_timeout_s`, then the rest are cancelled and answered 503; only then
does uvicorn close its connections. Under another ASGI server the lifespan shutdown does the same
for whatever that server left running.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import signal
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from vlforge.config import ConfigError
from vlforge.data.inline import DataError
from vlforge.tools.calls import ToolCall, format_tool_calls
from vlforge.serve.answers import aborted, answer_message, generation_error, shutdown_error, sse_stream, usage
from vlforge.serve.batcher import Batcher, Job
from vlforge.serve.config import ServeConfig
from vlforge.infer.model import Completion, Request
from vlforge.serve.images import ImageLoader
from vlforge.serve.metrics import CountRequests, ServeMetrics
from vlforge.serve.schema import (APIError, ChatRequest, error_body, image_limits, parse_chat_request,
                                  validation_message)

log = logging.getLogger("vlforge.serve")
ABORT_GRACE_S = 30.0  # after the drain timeout: how long the cancelled requests get to stop and be answered


class _Server:
    """State shared by the handlers: the vlm, its batcher, the settings."""

    def __init__(self, vlm, cfg: ServeConfig, images: ImageLoader, batcher: Batcher):
        self.vlm, self.cfg, self.images, self.batcher = vlm, cfg, images, batcher
        self.model_name = cfg.model_name
        self.created = int(time.time())

    async def read_body(self, request: HTTPRequest) -> bytearray:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        try:
            too_big = declared is not None and int(declared) > limit
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        body, total = bytearray(), 0
        timeout = self.cfg.body_timeout_s
        try:
            # one deadline for the whole body, not per chunk: a client trickling a byte at a time must
            # not hold its connection and this task for ever (uvicorn bounds neither)
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    total += len(chunk)
                    if not too_big:
                        body += chunk
                        too_big = len(body) > limit
                    if too_big:
                        body = bytearray()
                        if total > 2 * limit:  # read (and drop) a moderate excess so the client sees the 413
                            break
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the request") from None
        except TimeoutError:
            # too big: the size is what is wrong (the 413 below); the timeout only ended the drain of the excess.
            # Connection: close: the rest of the body may still come, and must not be read as a next request
            if not too_big:
                raise APIError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout); send "
                                    "it at once, or ask the server's operator for a longer timeout",
                               code="request_timeout", headers={"Connection": "close"}) from None
        if too_big:  # Connection: close: uvicorn would otherwise read the unread rest with no deadline
            raise APIError(413, f"request body is larger than the limit of {limit} bytes; send smaller or fewer "
                                "images", code="request_too_large", headers={"Connection": "close"})
        return body  # not copied into bytes: json.loads reads a bytearray

    async def drain(self, give_up=lambda: False) -> None:
        """Refuse new requests (503) and wait up to cfg.drain_timeout_s for the accepted ones to be
        answered; then cancel the rest (their clients get 503) and wait, briefly, for them to stop.
        `give_up()` true (a second Ctrl+C) ends either wait at once."""
        batcher = self.batcher
        batcher.draining = True
        if not await _until(lambda: not batcher.unfinished or give_up(), self.cfg.drain_timeout_s):
            log.warning("shutdown: %d requests still unfinished after the drain timeout of %g s; cancelling them",
                        batcher.unfinished, self.cfg.drain_timeout_s)
            batcher.abort()
            await _until(lambda: not batcher.unfinished or give_up(), ABORT_GRACE_S)

    def prepare(self, body: bytearray) -> tuple[Request, Any, bool, bool, int]:
        """(the engine's request, its prompt as the vlm prepared it (ids and pixels: done here, in a worker
        thread, so that the one thread feeding the GPU only adds it), stream?, include usage?, tool calls
        the answer may carry: 0 when the request has no tools or tool_choice none, 1 with
        parallel_tool_calls false, else -1 for all). Nothing of the body or of the parsed JSON outlives
        this call: the engine's request holds the text and the decoded (shrunk) images."""
        try:
            req = parse_chat_request(body, self.cfg)
        finally:
            body.clear()  # the caller's reference too: a large body is freed now, not when the answer is done
        calls = 0 if not req.tools or req.tool_choice == "none" else 1 if req.parallel_tool_calls is False else -1
        request = self.build(req)
        return (request, self._count(self.vlm.prepare, request), bool(req.stream),
                bool(req.stream_options and req.stream_options.include_usage), calls)

    def build(self, req: ChatRequest) -> Request:
        """The engine's request: prompt length bounded, images decoded, prompt tokens counted. An
        assistant message's tool calls become its text in the model's own format (tools/calls.py's
        format_tool_calls: what the model generated), a tool message the chat template's tool turn."""
        messages, image_urls, video_urls, tool_images = [], [], [], set()
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role
            if m.tool_calls:
                calls = format_tool_calls([ToolCall(c.function.name, json.loads(c.function.arguments))
                                           for c in m.tool_calls])
                text = m.content if isinstance(m.content, str) else "".join(
                    p.text for p in m.content or [] if p.type == "text")
                messages.append({"role": role, "content": f"{text}\n{calls}" if text else calls})
                continue
            if isinstance(m.content, str):
                messages.append({"role": role, "content": m.content})
                continue
            content = []
            for j, part in enumerate(m.content):
                if part.type == "text":
                    content.append({"type": "text", "text": part.text})
                elif part.type == "video_url":
                    video_urls.append((part.url, f"messages.{i}.content.{j}.video_url"))
                    content.append({"type": "video"})
                else:
                    if role == "tool":  # resized as GRPO's tools' images were (tool_image_limit)
                        tool_images.add(len(image_urls))
                    image_urls.append((part.url, f"messages.{i}.content.{j}.image_url"))
                    content.append({"type": "image"})
            messages.append({"role": role, "content": content})
        limit = self.cfg.max_prompt_tokens
        # a bound from the prompt's length in characters, before any tokenizing or image decoding: a
        # long text is refused without the tokenizer's memory for it (hundreds of bytes per character)
        at_least = self._count(self.vlm.min_prompt_tokens, messages)
        if at_least > limit:
            raise APIError(400, f"the prompt is at least {at_least} tokens (from its length in characters); the "
                                f"limit is {limit}", param="messages", code="context_length_exceeded")
        limits = self.limits(req)
        images = [self.images.load(url, param, limits and limits.max_pixels) for url, param in image_urls]
        if tool_images and (bound := self.cfg.tool_image_max_pixels or self.vlm.tool_image_max_pixels):
            encoder = self.vlm.encoder_at(limits)
            images = [encoder.fit_within(im, bound) if k in tool_images else im for k, im in enumerate(images)]
        videos = [self.images.load_video(url, param) for url, param in video_urls]  # headers: nothing decoded
        temperature = 1.0 if req.temperature is None else req.temperature
        # greedy ignores top_p: normalise it so greedy requests share a generate call (the engine groups
        # a batch by its sampling settings)
        top_p = 1.0 if req.top_p is None or temperature == 0 else req.top_p
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" \
            else None
        request = Request(messages=messages, images=images, videos=videos, tools=tools,
                          max_new_tokens=req.asked_tokens or min(self.cfg.default_max_tokens, self.cfg.max_tokens),
                          temperature=temperature, top_p=top_p, stop=req.stops, min_new_tokens=req.min_tokens or 0,
                          image_limits=limits, seed=req.seed)
        n_prompt = self._count(self.vlm.prompt_tokens, request)  # videos counted from their headers
        if n_prompt > limit:
            raise APIError(400, f"the prompt is {n_prompt} tokens (images included); the limit is {limit}",
                           param="messages", code="context_length_exceeded")
        if videos:  # decoded now, once the prompt fits
            request.video_frames = [self._decoded(video, param) for video, (_, param) in zip(videos, video_urls)]
        return request

    def limits(self, req: ChatRequest):
        """The request's own ImageLimits (its min_pixels/max_pixels within the engine's), or None."""
        own = getattr(getattr(self.vlm, "encoder", None), "limits", None)
        asked = image_limits(req, None if own is None else (own.min_pixels, own.max_pixels))
        return None if asked is None else replace(own, min_pixels=asked[0], max_pixels=asked[1])

    def _decoded(self, video, param: str):
        """The frames of `video` the model sees, decoded now: a corrupt video fails its own request
        here, not the batch it would join."""
        try:
            return self.vlm.encoder.decode_video(video, param)
        except DataError as e:
            raise APIError(400, str(e).removeprefix(f"{param}: "), param=param, code="invalid_video") from None

    @staticmethod
    def _count(count, what) -> int:
        try:
            return count(what)
        except Exception as e:  # noqa: BLE001 - the chat template or the image sizes refused the request
            raise APIError(400, f"cannot build the prompt: {e}", param="messages", code="invalid_value") from None


def create_app(vlm, cfg: ServeConfig | None = None) -> FastAPI:
    """The ASGI app serving `vlm` (an infer/model.InferenceModel, or anything with `name`,
    `min_prompt_tokens(messages)`, `prompt_tokens(request)`, `prepare(request)` and the pull API the
    batcher drives: `open`, `add(request, prompt)`, `step`, `cancel`) with the settings `cfg`."""
    cfg = cfg or ServeConfig()
    cfg = replace(cfg, model_name=cfg.model_name or vlm.name)
    metrics = ServeMetrics()
    batcher = Batcher(vlm, max_batch=cfg.max_batch, window_s=cfg.batch_window_s, max_queue=cfg.max_queue,
                      metrics=metrics)
    metrics.watch(batcher, vlm)
    keep = getattr(getattr(vlm, "encoder", None), "limits", None)
    state = _Server(vlm, cfg, ImageLoader(cfg, keep.max_pixels if keep else None), batcher)
    preparing = asyncio.Semaphore(max(2, cfg.max_batch))  # bounds images decoded but not yet queued

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await state.drain()  # DrainingServer drained already, before closing the connections: then nothing is left
        await asyncio.to_thread(batcher.close, ABORT_GRACE_S)

    app = FastAPI(title="vlforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.vlforge = state
    app.state.metrics = metrics
    if cfg.api_key is not None:
        app.add_middleware(RequireKey, key=cfg.api_key)
    app.add_middleware(CountRequests, metrics=metrics)  # added last: outermost, so refusals are counted too
    _answer_errors_as_openai(app)

    @app.get("/health")
    async def health():
        if batcher.draining:  # a load balancer's probe: send no more requests here
            return JSONResponse({"status": "draining", "model": state.model_name, **batcher.stats()}, status_code=503)
        return {"status": "ok", "model": state.model_name, **batcher.stats()}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HTTPRequest):
        arrived = time.monotonic()
        batcher.check_room()  # shutting down, or the queue full: refuse before reading the body
        body = await state.read_body(http_request)
        batcher.check_room()  # again (a large body takes a while): refuse before decoding anything
        # JSON parsing, image decoding and token counting run in a worker thread, off the event loop
        async with preparing:
            request, prompt, stream, include_usage, tool_calls = await asyncio.to_thread(state.prepare, body)
        job = Job(request, stream, asyncio.get_running_loop(), asyncio.Queue(), arrived=arrived, prompt=prompt)
        batcher.submit(job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if job.stream:
            return StreamingResponse(sse_stream(job, rid, created, state.model_name, include_usage, tool_calls),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        c = await _wait(job, http_request)
        if c is None:  # the client went away; nobody reads this
            return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)
        message, finish = answer_message(c, tool_calls)
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage(c)}

    return app


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error the app raises answered in OpenAI's error shape: ours (APIError), a body that
    fails validation (400), Starlette's (404, 405, ...), and anything else (500, logged)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500
                                        else "server_error", None, None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


class RequireKey:
    """ASGI middleware: every HTTP route but /health, and every websocket, needs `Authorization:
    Bearer KEY` (401 in OpenAI's shape otherwise). The key is compared in constant time and never
    logged nor echoed. Plain ASGI (not BaseHTTPMiddleware): streamed answers and disconnect
    detection pass through untouched. `lifespan` (the server's startup and shutdown; no client)
    passes; any other scope type is refused, as the ASGI spec asks of an app that does not know it
    (a new kind of connection must not get in unauthenticated)."""

    OPEN = ("/health",)  # load balancers and orchestrators probe it without credentials

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan" or (kind == "http" and scope["path"] in self.OPEN):
            return await self.app(scope, receive, send)
        if kind not in ("http", "websocket"):
            raise RuntimeError(f"vlforge serve does not handle ASGI {kind!r} connections")
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        scheme, _, token = (given or b"").partition(b" ")
        # compare_digest on bytes: its time does not depend on where the first wrong byte is
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("this server needs an API key: send the header `Authorization: Bearer KEY`" if given is None
                   else "invalid API key (the header must be `Authorization: Bearer KEY`)")
        response = JSONResponse(error_body(message, "invalid_request_error", None, "invalid_api_key"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if kind == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            # refused before the handshake completes: the server answers it with 403 (ASGI's close
            # before accept); with the denial-response extension the client gets the 401 itself
            return await send({"type": "websocket.close", "code": 1008})
        await response(scope, receive, send)  # Starlette sends a websocket scope's as websocket.http.response.*


async def _wait(job: Job, http_request: HTTPRequest) -> Completion | None:
    """The job's completion, or None when the client disconnects first (the job is then cancelled)."""

    async def disconnected() -> None:
        while (await http_request.receive())["type"] != "http.disconnect":  # the body was read already
            pass

    watch = asyncio.create_task(disconnected())
    try:
        while True:
            get = asyncio.create_task(job.events.get())
            done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                job.cancel()
                return None
            kind, payload = get.result()
            if kind == "done":
                if aborted(job, payload):
                    raise shutdown_error()
                return payload
            if kind == "error":
                raise generation_error(payload)
    except asyncio.CancelledError:
        job.cancel()
        raise
    finally:
        watch.cancel()


def _model_card(state: _Server) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "vlforge"}


async def _until(condition, timeout: float) -> bool:
    """Poll `condition` (every 50 ms, on the event loop) until true or `timeout` s; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


def require_uvicorn():
    """uvicorn, imported only where a server runs (`serve`, DrainingServer): importing this module,
    e.g. to run `create_app`'s app under another ASGI server, needs fastapi but not uvicorn. The CLI
    calls it before loading a model, so a missing uvicorn is said at once."""
    try:
        import uvicorn
    except ImportError as e:
        raise ConfigError(f"vlforge serve needs uvicorn ({e.name} is missing): pip install 'vlforge[serve]'") from None
    return uvicorn


@functools.cache
def _draining_server() -> type:
    uvicorn = require_uvicorn()

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, draining before its own shutdown (which closes the listening socket and
        then waits, without limit, for the open connections): new requests meanwhile get 503, and a
        drain longer than the app's drain timeout is cut short (see `_Server.drain`). A second Ctrl+C
        (uvicorn's force exit) ends the drain at once."""

        async def shutdown(self, sockets=None):
            state = getattr(getattr(self.config.app, "state", None), "vlforge", None)
            if state is not None:
                await state.drain(give_up=lambda: self.force_exit)
            await super().shutdown(sockets)

    DrainingServer.__module__ = __name__
    return DrainingServer


HEADER_TIMEOUT_BODY = json.dumps(error_body("the request line and headers did not arrive in time (--header-timeout)",
                                            APIError.TYPES[408], code="request_timeout")).encode()
HEADER_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                           b"content-length: %d\r\n\r\n" % len(HEADER_TIMEOUT_BODY)) + HEADER_TIMEOUT_BODY


@functools.cache
def header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP protocol (httptools or h11, whichever uvicorn picks) with a deadline for each
    request's line and headers: `seconds` from the connection's start, or from the first byte after
    its previous answer (idle kept-alive connections are uvicorn's own timeout_keep_alive). Past it
    the client gets 408 and the connection closes. uvicorn has no such timeout (only the request
    body has one, the app's --body-timeout), so written here, on the protocol class uvicorn takes
    as `Config(http=...)`."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderDeadline(AutoHTTPProtocol):
        _deadline = None
        _armed_for = None  # the request cycle current when armed: a new one means the headers came

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            between = self.cycle is None or self.cycle.response_complete  # these bytes start a request
            if between and (self._deadline is None or self._armed_for is not self.cycle):
                self._arm()
            super().data_received(data)

        def connection_lost(self, exc):
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._armed_for = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _expired(self) -> None:
            self._deadline = None
            waiting = self.cycle is self._armed_for and (self.cycle is None or self.cycle.response_complete)
            # get_protocol: a websocket upgrade hands the transport to another protocol, never this one's
            # connection_lost: a live websocket is not ours to time out
            if waiting and not self.transport.is_closing() and self.transport.get_protocol() is self:
                self.transport.write(HEADER_TIMEOUT_RESPONSE)
                self.transport.close()

    return HeaderDeadline


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """The uvicorn.Config `serve` runs `app` (create_app's) with: its --header-timeout on the protocol."""
    uvicorn = require_uvicorn()
    state = getattr(getattr(app, "state", None), "vlforge", None)
    timeout = state.cfg.header_timeout_s if state is not None else ServeConfig().header_timeout_s
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=header_deadline_protocol(timeout))


def __getattr__(name: str):
    # `from vlforge.serve.app import DrainingServer` still works; the class is made on first use,
    # since its base class is uvicorn's
    if name == "DrainingServer":
        return _draining_server()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int | None:
    """Serve `app` (create_app's) with uvicorn until SIGINT/SIGTERM, then drain (DrainingServer).
    Returns the signal it stopped on (None: it stopped otherwise). uvicorn raises that signal again
    once shut down, so that the process ends as the signal would have ended it: Ctrl-C's
    KeyboardInterrupt (and SIGTERM's, where the CLI makes it one: train/stop.py) is that end, not
    an error, and its traceback would say nothing."""
    server = _draining_server()(uvicorn_config(app, host, port, log_level))
    try:
        server.run()
    except KeyboardInterrupt as e:
        if not server.should_exit:  # not uvicorn's shutdown: somebody else's interrupt
            raise
        return getattr(e, "signum", signal.SIGINT)
    return None


__all__ = ["create_app", "require_uvicorn", "serve", "uvicorn_config"]  # and DrainingServer, made on first use (__getattr__)
