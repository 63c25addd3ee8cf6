"""The request schema of the chat completions endpoint (pydantic models of OpenAI's shape), the
checks a parsed request must pass, and the errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`.

    req = parse_chat_request(body, cfg)     # ChatRequest, or raises APIError (400/404) saying what is wrong
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from vlforge.serve.config import ServeConfig


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Schema(BaseModel):
    # unknown fields ignored (clients send many optional ones); strict types: `"max_tokens": true` or
    # `"stream": "yes"` are errors, not 1 and True (JSON numbers still fill float fields)
    model_config = ConfigDict(extra="ignore", strict=True)


def _whole_number(value):
    """An integral float (256.0: some clients serialise every number as a float) as the int it is;
    anything else goes on to the strict int check (a boolean, a string or 256.5 is refused there)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_Int = Annotated[int, BeforeValidator(_whole_number)]


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


class _VideoPart(_Schema):
    """vLLM's extension of OpenAI's parts: {"type": "video_url", "video_url": {"url": ...}}."""

    type: Literal["video_url"]
    video_url: _ImageURL | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url


_Part = Annotated[Union[_TextPart, _ImagePart, _VideoPart], Field(discriminator="type")]


class _FunctionCall(_Schema):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class _ToolCall(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that made tool calls (checked in parse_chat_request)
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant message's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # a participant's name (OpenAI: any role; unused by the chat template); a tool message's, if given,
    # must be the function it answers (some clients send it)
    name: str | None = None


class _FunctionDef(_Schema):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class _Tool(_Schema):
    type: Literal["function"]
    function: _FunctionDef


class _StreamOptions(_Schema):
    include_usage: bool = False


class ChatRequest(_Schema):
    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    max_tokens: _Int | None = Field(None, ge=1)
    max_completion_tokens: _Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default, 1, when absent
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    n: _Int | None = 1
    # OpenAI's: sampling with the same seed (and prompt and settings) gives the same answer (generate/'s
    # engine: the noise is a function of the seed and the step)
    seed: _Int | None = None
    # vLLM's extension: no end of turn before this many tokens (benchmarks, and tests of long generations)
    min_tokens: _Int | None = Field(None, ge=0)
    # vlforge's extension: this request's image resize bounds (pixels per image, width x height), within
    # the server's own (--min-pixels/--max-pixels); an image is resized as the processor would at these
    min_pixels: _Int | None = Field(None, ge=1)
    max_pixels: _Int | None = Field(None, ge=1)
    # function calling: the tools' schemas go to the chat template (Qwen's lists them in the system
    # prompt); a reply's <tool_call> blocks come back as message.tool_calls (finish_reason "tool_calls")
    tools: list[_Tool] | None = None
    tool_choice: str | dict | None = None  # "auto" (the default with tools) or "none"
    parallel_tool_calls: bool | None = None  # false: only a reply's first call is returned
    # accepted only when empty/off: features this server does not have (refused, not ignored: each
    # changes what a client gets back, e.g. json_object mode promises parseable JSON)
    functions: list | None = None
    logprobs: bool | None = None
    top_logprobs: _Int | None = None
    response_format: dict | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def asked_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens; None when the request does not say."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def image_limits(req: ChatRequest, server: tuple[int, int] | None) -> tuple[int, int] | None:
    """The request's (min_pixels, max_pixels), each side defaulting to the server's own `server`;
    None when the request names neither. Refused (400, naming the field) outside the server's bounds:
    a request may ask for fewer pixels per image than the server allows, or more of its small images'
    detail, never more work per image than the operator set."""
    if req.min_pixels is None and req.max_pixels is None:
        return None
    if server is None:
        param = "min_pixels" if req.min_pixels is not None else "max_pixels"
        raise APIError(400, "this server does not resize images per request", param=param, code="unsupported")
    lo, hi = server
    if req.min_pixels is not None and req.min_pixels < lo:
        raise APIError(400, f"min_pixels={req.min_pixels} is below this server's lower bound of {lo} pixels per "
                            f"image; ask for {lo}..{hi}", param="min_pixels", code="invalid_value")
    if req.max_pixels is not None and req.max_pixels > hi:
        raise APIError(400, f"max_pixels={req.max_pixels} is above this server's limit of {hi} pixels per image; "
                            f"ask for {lo}..{hi}", param="max_pixels", code="invalid_value")
    want_lo = lo if req.min_pixels is None else req.min_pixels
    want_hi = hi if req.max_pixels is None else req.max_pixels
    if want_lo > want_hi:
        said = (f"min_pixels={want_lo} is above max_pixels={want_hi}" if req.min_pixels is not None and
                req.max_pixels is not None else f"min_pixels={want_lo} is above this server's max_pixels {want_hi}"
                if req.min_pixels is not None else f"max_pixels={want_hi} is below this server's min_pixels {want_lo}")
        raise APIError(400, f"{said}; min_pixels must be <= max_pixels",
                       param="min_pixels" if req.min_pixels is not None else "max_pixels", code="invalid_value")
    return want_lo, want_hi


def validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
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


def _check_tool_turns(messages: list[_Message]) -> None:
    """OpenAI's rules for a conversation with tool calls: a tool message answers a call of the
    assistant message before it (by tool_call_id), and every such call is answered before the
    conversation goes on. The model reads each result as the answer to a call: a result matched
    to no call, or a call left without one, would be a conversation it never had. A tool message's
    `name`, where a client sends one, must be the function of the call it answers."""
    open_calls: dict[str, int] = {}  # the last assistant message's unanswered calls -> that message
    functions: dict[str, str] = {}  # call id -> its function's name
    for i, m in enumerate(messages):
        if m.role == "tool":
            if m.tool_call_id not in open_calls:
                said = f"tool_call_id {m.tool_call_id!r}" if m.tool_call_id else "no tool_call_id"
                raise APIError(400, f"messages.{i}: a tool message must answer a call of the assistant message before "
                                    f"it, by its id; this one has {said}, which answers none of "
                                    f"{sorted(open_calls) or 'no calls'}", param=f"messages.{i}.tool_call_id",
                               code="invalid_value")
            if m.name is not None and m.name != functions[m.tool_call_id]:
                raise APIError(400, f"messages.{i}: this tool message is named {m.name!r}, but the call "
                                    f"{m.tool_call_id!r} it answers is to {functions[m.tool_call_id]!r}",
                               param=f"messages.{i}.name", code="invalid_value")
            del open_calls[m.tool_call_id]
            continue
        if open_calls:
            raise APIError(400, f"messages.{i}: the assistant message {next(iter(open_calls.values()))}'s tool calls "
                                f"{sorted(open_calls)} have no tool messages with their results before it",
                           param=f"messages.{i}", code="invalid_value")
        if m.tool_calls:
            ids = [c.id for c in m.tool_calls]
            if len(set(ids)) != len(ids):
                raise APIError(400, f"messages.{i}.tool_calls: two calls with one id", param=f"messages.{i}.tool_calls",
                               code="invalid_value")
            open_calls = dict.fromkeys(ids, i)
            functions = {c.id: c.function.name for c in m.tool_calls}
    if open_calls:
        raise APIError(400, f"the assistant message {next(iter(open_calls.values()))}'s tool calls "
                            f"{sorted(open_calls)} have no tool messages with their results",
                       param="messages", code="invalid_value")


def parse_chat_request(body: bytes | bytearray, cfg: ServeConfig) -> ChatRequest:
    """The request body as a ChatRequest, checked against what this server supports and its limits
    (`cfg.model_name` is the served model's id)."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        req = ChatRequest.model_validate(payload)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param=param, code="invalid_value") from None
    if req.model not in (None, "", cfg.model_name):
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {cfg.model_name!r}",
                       param="model", code="model_not_found")
    if (req.n or 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n", code="invalid_value")
    if req.functions:
        raise APIError(400, "functions (OpenAI's deprecated form) are not supported by this server: send tools",
                       param="functions", code="unsupported")
    if req.tool_choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice={req.tool_choice!r} is not supported by this server (it cannot force a "
                            "call): use 'auto' or 'none'", param="tool_choice", code="unsupported")
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools with one name", param="tools", code="invalid_value")
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages.{i}.content is missing (only an assistant message with tool_calls may "
                                "leave it out)", param=f"messages.{i}.content", code="invalid_value")
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages.{i}: only assistant messages carry tool_calls",
                           param=f"messages.{i}.tool_calls", code="invalid_value")
        for j, call in enumerate(m.tool_calls or []):
            try:
                ok = isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments must be a JSON object (as "
                                    "text)", param=f"messages.{i}.tool_calls.{j}.function.arguments",
                               code="invalid_value")
    _check_tool_turns(req.messages)
    off = {"logprobs": not req.logprobs, "top_logprobs": not req.top_logprobs, "logit_bias": not req.logit_bias,
           "response_format": (req.response_format or {}).get("type", "text") == "text",
           "presence_penalty": not req.presence_penalty, "frequency_penalty": not req.frequency_penalty}
    for name, ok in off.items():
        if not ok:
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported")
    if len(req.stops) > 4 or any(not s for s in req.stops):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop", code="invalid_value")
    asked = req.asked_tokens
    if asked is not None and asked > cfg.max_tokens:
        raise APIError(400, f"max_tokens={asked} is above this server's limit of {cfg.max_tokens}",
                       param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                       code="invalid_value")
    if req.min_tokens and req.min_tokens > (asked or min(cfg.default_max_tokens, cfg.max_tokens)):
        raise APIError(400, f"min_tokens={req.min_tokens} is above the request's max_tokens", param="min_tokens",
                       code="invalid_value")
    parts = [p for m in req.messages if isinstance(m.content, list) for p in m.content]
    n_images = sum(isinstance(p, (_ImagePart, _VideoPart)) for p in parts)
    if n_images > cfg.max_images:
        videos = " and videos" if any(isinstance(p, _VideoPart) for p in parts) else ""
        raise APIError(400, f"{n_images} images{videos} in one request; the limit is {cfg.max_images}",
                       param="messages", code="too_many_images")
    return req


__all__ = ["APIError", "ChatRequest", "error_body", "image_limits", "parse_chat_request", "validation_message"]
