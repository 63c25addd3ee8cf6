"""An engine's Completion as the OpenAI chat answer: the assistant message (a reply's <tool_call>
blocks as tool_calls), its usage, the errors a generation ends with, and the streamed form
(server-sent events, `sse_stream`), whose deltas add up to the non-streamed message."""

from __future__ import annotations

import asyncio
import json
import uuid

from vlforge.tools.calls import ToolCall, ToolCallStream, split_tool_calls
from vlforge.serve.batcher import Job, ShuttingDown
from vlforge.infer.model import Completion
from vlforge.serve.schema import APIError, error_body


def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def generation_error(exc: BaseException) -> APIError:
    if isinstance(exc, ShuttingDown):
        return shutdown_error(str(exc))
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", code="generation_failed")


def aborted(job: Job, c: Completion) -> bool:
    """The answer was cut off by the server's shutdown (not by its client, nor finished anyway)."""
    return job.aborted and c.finish_reason == "cancelled"


def shutdown_error(message: str = "the server shut down before this answer was finished") -> APIError:
    return APIError(503, f"{message}; retry later", code="shutting_down")


def answer_message(c: Completion, tool_calls: int) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a completion; with tools (`tool_calls` != 0, see
    prepare), the reply's well-formed <tool_call> blocks as OpenAI's tool_calls (at most the first
    with `tool_calls` 1), finish_reason "tool_calls" and the rest of the text as the content (None
    when empty)."""
    if not tool_calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = split_tool_calls(c.text)
    if not calls:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    calls = calls[:1] if tool_calls == 1 else calls
    return {"role": "assistant", "content": content or None, "tool_calls": [call_json(call) for call in calls]}, \
        "tool_calls" if c.finish_reason == "stop" else c.finish_reason


def call_json(call: ToolCall) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


async def sse_stream(job: Job, rid: str, created: int, model: str, include_usage: bool, tool_calls: int = 0):
    """The answer as server-sent events. With tools (`tool_calls` != 0) the text goes out as it
    comes, but for what may be a <tool_call> block (tools/calls.ToolCallStream); each block becomes a
    call once it closes, sent as a tool_calls delta with its index (OpenAI's chunk shape): the
    deltas add up to the non-streamed answer (answer_message)."""
    def chunk(delta: dict, finish: str | None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    calls = ToolCallStream(max_calls=1 if tool_calls == 1 else 0) if tool_calls else None
    sent_calls = 0

    def deltas(events) -> list[str]:
        nonlocal sent_calls
        out = []
        for kind, value in events:
            if kind == "content":
                out.append(chunk({"content": value}, None))
            else:
                out.append(chunk({"tool_calls": [{"index": sent_calls, **call_json(value)}]}, None))
                sent_calls += 1
        return out

    def lines(kind: str, payload) -> tuple[list[str], bool]:
        """One event's SSE lines, and whether it ends the answer."""
        if kind == "text":
            return (deltas(calls.feed(payload)) if calls else [chunk({"content": payload}, None)]), False
        if kind == "done" and not aborted(job, payload):
            finish = payload.finish_reason
            out = deltas(calls.finish()) if calls else []
            if sent_calls and finish == "stop":
                finish = "tool_calls"
            out.append(chunk({}, finish))
            if include_usage:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": usage(payload)}
                out.append(f"data: {json.dumps(body)}\n\n")
            return out, True
        # the status line went out already: report the error as an event
        err = shutdown_error() if kind == "done" else generation_error(payload)
        return [f"data: {json.dumps(error_body(err.message, err.type, err.param, err.code))}\n\n"], True

    finished = False
    try:
        yield chunk({"role": "assistant"}, None)
        ended = False
        while not ended:
            # every event already queued goes out as one write. Written one by one, a burst of tokens
            # reached a client that had just left as many writes in one turn of the event loop, before
            # the disconnect could cancel this stream: asyncio logs "socket.send() raised exception."
            # from the 5th write to a lost connection on. One write a turn, the next turn cancels.
            out = []
            for kind, payload in await queued(job.events):
                more, ended = lines(kind, payload)
                out += more
                if ended:
                    break
            if ended:
                finished = True
                out.append("data: [DONE]\n\n")
            yield "".join(out)
    finally:
        if not finished:
            # the client disconnected (Starlette cancels the response's task when it reads http.disconnect)
            job.cancel()


async def queued(events: asyncio.Queue) -> list:
    """The next event (waited for) and every event already queued behind it."""
    out = [await events.get()]
    while not events.empty():
        out.append(events.get_nowait())
    return out
