"""OpenAI-compatible HTTP server around an `InferenceEngine` (FastAPI + uvicorn).

    engine = InferenceEngine.load("merged/", quant=QuantConfig.from_flag("nf4"))
    app = create_app(engine, allow_files="/data/images", max_batch=8)
    uvicorn.run(app, host="127.0.0.1", port=8000)         # what `vlforge serve` does

Endpoints: `POST /v1/chat/completions` (OpenAI's chat completions shape, `stream: true` for
server-sent events), `GET /v1/models`, `GET /health`. Every error is a 4xx/5xx in OpenAI's
shape `{"error": {"message", "type", "param", "code"}}`, and the server keeps serving.

Batching: one background thread owns the engine. Handlers validate a request (images decoded
and prompt length counted in a worker thread, off the event loop), put it on a queue and await
its events; the thread takes what is waiting (up to `max_batch`, after a gather window of a few
ms) and runs one `engine.generate(batch, on_text=...)` for all of it, routing each request's
streamed text to that request's asyncio queue through `loop.call_soon_threadsafe`.

Images: `data:image/...;base64,...` URLs; local paths or `file://` URLs only under `allow_files`
(resolved with symlinks followed, refused outside that directory); never http(s) (no fetching).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import os
import queue
import re
import stat
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import unquote, urlparse

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest

from vlforge.serve.engine import Completion, Request

log = logging.getLogger("vlforge.serve")

# Formats PIL may open: the common web formats only (PIL's EPS plugin, for one, runs Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 20 * 1024 * 1024  # request body (JSON, base64 images included)
    max_image_pixels: int = 4096 * 4096  # per image, checked on the header before decoding
    max_images: int = 8  # per request
    max_prompt_tokens: int = 8192  # chat template + image tokens, as the engine counts them
    max_tokens: int = 4096  # largest max_tokens a request may ask for
    default_max_tokens: int = 512  # when a request does not say


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(_error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def _error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------- request schema


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send many optional fields; unknown ones are ignored


class _ImageURL(_Schema):
    url: str
    detail: str | None = None


class _TextPart(_Schema):
    type: Literal["text"]
    text: str


class _ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: _ImageURL | str  # OpenAI sends {"url": ...}; a bare string is accepted too

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


_Part = Annotated[Union[_TextPart, _ImagePart], Field(discriminator="type")]


class _Message(_Schema):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_Part]


class _StreamOptions(_Schema):
    include_usage: bool = False


class ChatRequest(_Schema):
    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default, 1, when absent
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    n: int | None = 1
    # accepted only when empty/off: features this server does not have
    tools: list | None = None
    functions: list | None = None
    logprobs: bool | None = None


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the most specific error. pydantic tries each branch of a union
    (`content`: a string or a list of parts) and names the branches in `loc`; those labels
    ("str", "list[...]", private class names, the repeated discriminator tag) are dropped."""
    def clean(loc) -> list[str]:
        out: list[str] = []
        for x in map(str, loc):
            if x in ("body", "str") or "[" in x or x.startswith("_") or (out and out[-1] == x):
                continue
            out.append(x)
        return out

    errors = [(clean(e.get("loc", ())), e.get("msg", "invalid")) for e in err.errors()] or [([], "invalid request")]
    depth = max(len(loc) for loc, _ in errors)
    first = next(loc for loc, _ in errors if len(loc) == depth)
    loc = ".".join(first)
    message = "; or ".join(dict.fromkeys(msg for l, msg in errors if l == first))
    return (f"{loc}: {message}" if loc else message), (loc or None)


# ---------------------------------------------------------------------------------- batching


@dataclass(eq=False)
class _Job:
    request: Request
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: bool = False  # the client went away before its batch started: skip it

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class Batcher:
    """A single thread owning the engine: gathers waiting jobs into one `engine.generate` call."""

    def __init__(self, engine, max_batch: int = 8, window_s: float = 0.005, max_queue: int = 64):
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.engine, self.max_batch, self.window_s, self.max_queue = engine, max_batch, window_s, max_queue
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0  # engine.generate calls
        self.max_batch_seen = 0
        self.requests_done = 0
        self.skipped = 0  # requests whose client left before their batch started
        self.running = 0  # requests in the batch being generated now

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def stats(self) -> dict:
        return {"queue": self.waiting, "running": self.running, "batches": self.batches,
                "max_batch_seen": self.max_batch_seen, "requests": self.requests_done, "skipped": self.skipped}

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="vlforge-batcher", daemon=True)
                self._thread.start()

    def check_room(self) -> None:
        if self.waiting >= self.max_queue:
            raise APIError(503, f"the server is busy ({self.waiting} requests waiting); retry later",
                           code="queue_full")

    def submit(self, job: _Job) -> None:
        self.check_room()
        self.start()
        self._queue.put(job)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        batch, stop = [first], False
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:  # after the window, still take what is already waiting
                job = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            batch.append(job)
        return batch, stop

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            batch, stop = self._gather(first)
            live = [j for j in batch if not j.cancelled]
            self.skipped += len(batch) - len(live)
            batch = live
            if not batch:
                continue
            streaming = any(j.stream for j in batch)

            def on_text(i: int, text: str, batch=batch) -> None:
                if batch[i].stream:
                    batch[i].emit("text", text)

            self.batches += 1
            self.max_batch_seen = max(self.max_batch_seen, len(batch))
            self.running = len(batch)
            try:
                completions = self.engine.generate([j.request for j in batch], on_text=on_text if streaming else None)
            except Exception as e:  # noqa: BLE001 - answered to each client; the server keeps serving
                log.exception("generation failed for a batch of %d", len(batch))
                for j in batch:
                    j.emit("error", e)
            else:
                for j, c in zip(batch, completions):
                    j.emit("done", c)
            finally:
                self.running = 0
                self.requests_done += len(batch)
        while True:  # shutting down: answer whoever is still waiting
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.emit("error", RuntimeError("the server is shutting down"))


# ---------------------------------------------------------------------------------- images


class _ImageLoader:
    def __init__(self, limits: Limits, allow_files: str | Path | None, keep_pixels: int | None = None):
        self.limits = limits
        self.root = Path(allow_files).resolve() if allow_files is not None else None
        # the processor shrinks anything larger to this anyway: shrinking right after decoding keeps a
        # queue of waiting requests from holding full-resolution images
        self.keep_pixels = keep_pixels

    def load(self, url: str, param: str) -> Image.Image:
        url = url.strip()
        if url[:5].lower() == "data:":
            data = self._data_url(url, param)
        elif re.match(r"^https?://", url, re.I):
            raise APIError(400, "image URLs are not fetched (no network access from the server); send the image "
                                "inline as a data URL: data:image/png;base64,<base64 of the file>",
                           param=param, code="unsupported_image_url")
        elif url[:5].lower() == "file:" or not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url):
            data = self._local_file(url, param)
        else:
            raise APIError(400, f"unsupported image URL scheme in {url[:40]!r}; send a data:image/...;base64 URL",
                           param=param, code="unsupported_image_url")
        return self._decode(data, param)

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        fields = [f.strip().lower() for f in header.split(";")]
        if not sep or "base64" not in fields[1:]:
            raise APIError(400, "image data URLs must be base64: data:image/png;base64,...", param=param,
                           code="invalid_image_url")
        if fields[0] and not fields[0].startswith("image/"):
            raise APIError(400, f"data URL media type {fields[0]!r} is not an image", param=param,
                           code="invalid_image_url")
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "the image data URL is not valid base64", param=param, code="invalid_base64") from None

    def _local_file(self, url: str, param: str) -> bytes:
        if self.root is None:
            raise APIError(403, "local image files are not allowed on this server (the operator can allow a "
                                "directory with --allow-files DIR); send the image as a data:image/...;base64 URL",
                           param=param, code="files_not_allowed")
        raw = url
        if url[:5].lower() == "file:":
            parsed = urlparse(url)
            if parsed.netloc not in ("", "localhost"):
                raise APIError(400, "file:// URLs must name a local path (file:///path)", param=param,
                               code="invalid_image_url")
            raw = unquote(parsed.path)
        if not raw or "\x00" in raw:
            raise APIError(400, "empty or invalid image path", param=param, code="invalid_image_url")
        path = Path(raw)
        if not path.is_absolute():
            path = self.root / path  # relative paths are relative to the allowed directory
        try:
            resolved = path.resolve()  # follows every symlink, removes ..
        except (OSError, RuntimeError):
            raise APIError(403, "the image path cannot be resolved", param=param, code="path_not_allowed") from None
        if not resolved.is_relative_to(self.root):
            raise APIError(403, f"image path {raw!r} is outside the directory this server allows", param=param,
                           code="path_not_allowed")
        if not resolved.is_file():
            raise APIError(400, f"image file {raw!r} not found", param=param, code="image_not_found")
        try:  # no symlink at the last step, no blocking on a FIFO swapped in since resolve()
            fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            raise APIError(400, f"cannot read image file {raw!r}: {e.strerror}", param=param,
                           code="image_not_found") from None
        with os.fdopen(fd, "rb") as f:
            # what was opened, not what was checked: closes the race of a directory on the path being
            # replaced by a symlink between resolve() and open() (Linux; elsewhere the check above stands)
            proc = Path(f"/proc/self/fd/{fd}")
            opened = Path(os.readlink(proc)) if proc.is_symlink() else resolved
            if not opened.is_relative_to(self.root) or not stat.S_ISREG(os.fstat(fd).st_mode):
                raise APIError(403, f"image path {raw!r} is outside the directory this server allows", param=param,
                               code="path_not_allowed")
            data = f.read(self.limits.max_body_bytes + 1)
        if len(data) > self.limits.max_body_bytes:
            raise APIError(413, f"image file {raw!r} is larger than {self.limits.max_body_bytes} bytes",
                           param=param, code="image_too_large")
        return data

    def _decode(self, data: bytes, param: str) -> Image.Image:
        limit = self.limits.max_image_pixels
        try:
            im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
        except Image.DecompressionBombError:
            raise APIError(400, f"image has more than {limit} pixels", param=param, code="image_too_large") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
            raise APIError(400, f"cannot decode the image (supported: {', '.join(IMAGE_FORMATS)})", param=param,
                           code="invalid_image") from None
        with im:
            w, h = im.size
            if w * h > limit:
                raise APIError(400, f"image is {w}x{h} = {w * h} pixels; the limit is {limit}", param=param,
                               code="image_too_large")
            if min(w, h) < 1 or max(w, h) / min(w, h) > 200:
                raise APIError(400, f"image is {w}x{h}: sides must be >= 1 pixel and the aspect ratio at most 200",
                               param=param, code="invalid_image")
            try:
                im.load()
                rgb = im.convert("RGB")
            except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
                raise APIError(400, "cannot decode the image (truncated or corrupt)", param=param,
                               code="invalid_image") from None
        if self.keep_pixels and w * h > self.keep_pixels:
            scale = (self.keep_pixels / (w * h)) ** 0.5
            rgb = rgb.resize((max(1, int(w * scale)), max(1, int(h * scale))), Image.Resampling.BICUBIC)
        return rgb


# ---------------------------------------------------------------------------------- the app


class _Server:
    """State shared by the handlers: the engine, its batcher, the limits."""

    def __init__(self, engine, model_name: str, limits: Limits, images: _ImageLoader, batcher: Batcher):
        self.engine, self.model_name, self.limits, self.images, self.batcher = engine, model_name, limits, images, batcher
        self.created = int(time.time())

    async def read_body(self, request: HTTPRequest) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        try:
            too_big = declared is not None and int(declared) > limit
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        body, total = bytearray(), 0
        try:
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
        if too_big:
            raise APIError(413, f"request body is larger than the limit of {limit} bytes; send smaller or fewer "
                                "images", code="request_too_large")
        return bytes(body)

    def parse(self, body: bytes) -> ChatRequest:
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = ChatRequest.model_validate(payload)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise APIError(400, message, param=param, code="invalid_value") from None
        if req.model not in (None, "", self.model_name):
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if (req.n or 1) != 1:
            raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise APIError(400, f"{name} are not supported by this server", param=name, code="unsupported")
        if req.logprobs:
            raise APIError(400, "logprobs are not supported by this server", param="logprobs", code="unsupported")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: up to 4 non-empty strings", param="stop", code="invalid_value")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if asked is not None and asked > self.limits.max_tokens:
            raise APIError(400, f"max_tokens={asked} is above this server's limit of {self.limits.max_tokens}",
                           param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                           code="invalid_value")
        n_images = sum(isinstance(p, _ImagePart) for m in req.messages if isinstance(m.content, list) for p in m.content)
        if n_images > self.limits.max_images:
            raise APIError(400, f"{n_images} images in one request; the limit is {self.limits.max_images}",
                           param="messages", code="too_many_images")
        return req

    def prepare(self, body: bytes) -> tuple[ChatRequest, Request]:
        req = self.parse(body)
        return req, self.build(req)

    def build(self, req: ChatRequest) -> Request:
        """The engine's request: images decoded, prompt length checked."""
        messages, images = [], []
        for i, m in enumerate(req.messages):
            role = "system" if m.role == "developer" else m.role
            if isinstance(m.content, str):
                messages.append({"role": role, "content": m.content})
                continue
            content = []
            for j, part in enumerate(m.content):
                if isinstance(part, _TextPart):
                    content.append({"type": "text", "text": part.text})
                else:
                    images.append(self.images.load(part.url, f"messages.{i}.content.{j}.image_url"))
                    content.append({"type": "image"})
            messages.append({"role": role, "content": content})
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        temperature = 1.0 if req.temperature is None else req.temperature
        # greedy ignores top_p: normalise it so greedy requests share a generate call (the engine groups
        # a batch by its sampling settings)
        top_p = 1.0 if req.top_p is None or temperature == 0 else req.top_p
        request = Request(messages=messages, images=images,
                          max_new_tokens=asked or min(self.limits.default_max_tokens, self.limits.max_tokens),
                          temperature=temperature, top_p=top_p, stop=stops)
        try:
            n_prompt = self.engine.prompt_tokens(request)
        except Exception as e:  # noqa: BLE001 - the chat template or the image sizes refused the request
            raise APIError(400, f"cannot build the prompt: {e}", param="messages", code="invalid_value") from None
        if n_prompt > self.limits.max_prompt_tokens:
            raise APIError(400, f"the prompt is {n_prompt} tokens (images included); the limit is "
                                f"{self.limits.max_prompt_tokens}", param="messages", code="context_length_exceeded")
        return request


def create_app(engine, *, model_name: str | None = None, allow_files: str | Path | None = None,
               max_batch: int = 8, batch_window_s: float = 0.005, max_queue: int = 64,
               max_body_bytes: int = Limits.max_body_bytes, max_image_pixels: int = Limits.max_image_pixels,
               max_images: int = Limits.max_images, max_prompt_tokens: int = Limits.max_prompt_tokens,
               max_tokens: int = Limits.max_tokens, default_max_tokens: int = Limits.default_max_tokens) -> FastAPI:
    """The ASGI app serving `engine` (anything with `name`, `prompt_tokens(request)` and
    `generate(requests, on_text)`). `allow_files`: a directory whose files (after resolving
    symlinks) requests may name as images; None: no local files at all."""
    if allow_files is not None and not Path(allow_files).is_dir():
        raise ValueError(f"allow_files={allow_files}: not a directory")
    limits = Limits(max_body_bytes, max_image_pixels, max_images, max_prompt_tokens, max_tokens, default_max_tokens)
    batcher = Batcher(engine, max_batch=max_batch, window_s=batch_window_s, max_queue=max_queue)
    keep = getattr(getattr(engine, "encoder", None), "limits", None)
    state = _Server(engine, model_name or engine.name, limits,
                    _ImageLoader(limits, allow_files, keep.max_pixels if keep else None), batcher)
    preparing = asyncio.Semaphore(max(2, max_batch))  # bounds images decoded but not yet queued

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await asyncio.to_thread(batcher.close)

    app = FastAPI(title="vlforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.vlforge = state

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(_error_body(message, "invalid_request_error", param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return JSONResponse(_error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500
                                        else "server_error", None, None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(_error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name, **batcher.stats()}

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
        body = await state.read_body(http_request)
        batcher.check_room()  # refuse before decoding anything when the queue is full
        # JSON parsing, image decoding and token counting run in a worker thread, off the event loop
        async with preparing:
            req, request = await asyncio.to_thread(state.prepare, body)
        job = _Job(request, bool(req.stream), asyncio.get_running_loop(), asyncio.Queue())
        batcher.submit(job)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if job.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(job, rid, created, state.model_name, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        c = await _wait(job, http_request)
        if c is None:  # the client went away; nobody reads this
            return JSONResponse(_error_body("client disconnected", "invalid_request_error"), status_code=499)
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "finish_reason": c.finish_reason}],
                "usage": _usage(c)}

    return app


async def _wait(job: _Job, http_request: HTTPRequest) -> Completion | None:
    """The job's completion, or None when the client disconnects first (the job is then marked
    cancelled, so the batcher skips it if its batch has not started)."""

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
                job.cancelled = True
                return None
            kind, payload = get.result()
            if kind == "done":
                return payload
            if kind == "error":
                raise _generation_error(payload)
    except asyncio.CancelledError:
        job.cancelled = True
        raise
    finally:
        watch.cancel()


def _model_card(state: _Server) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "vlforge"}


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def _generation_error(exc: BaseException) -> APIError:
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="generation_failed")


async def _sse(job: _Job, rid: str, created: int, model: str, include_usage: bool):
    def chunk(delta: dict, finish: str | None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    finished = False
    try:
        yield chunk({"role": "assistant"}, None)
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                yield chunk({"content": payload}, None)
            elif kind == "done":
                yield chunk({}, payload.finish_reason)
                if include_usage:
                    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(payload)}
                    yield f"data: {json.dumps(body)}\n\n"
                break
            else:  # the status line went out already: report the error as an event
                err = _generation_error(payload)
                yield f"data: {json.dumps(_error_body(err.message, err.type, err.param, err.code))}\n\n"
                break
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            job.cancelled = True  # the client disconnected: skip the job if its batch has not started


__all__ = ["APIError", "Batcher", "ChatRequest", "Limits", "create_app"]
