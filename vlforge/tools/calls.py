"""Qwen's tool-call text: the ``<tool_call>`` blocks of an assistant turn, parsed, streamed and written.

The model calls tools as Qwen3-VL's chat template teaches it: one or more
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks in an assistant turn. Data
(tool turns of a dataset), rollouts (the model's calls) and serve (OpenAI tool_calls) all read and
write this one format here; what a tool is lives in tools/registry.py, how a call runs in tools/runner.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

# Qwen's tool-call format (its chat template's "For each function call ..." instruction). Parsed by
# hand: transformers' response parsing needs a response schema the Qwen3-VL tokenizers do not ship.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict
    error: str | None = None  # a block that is not a call: the model is told why


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one assistant turn, in order. A block whose body is not a JSON object with
    a string "name" and an object "arguments" becomes a call with an `error` (the model is told)."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({e.msg} at column {e.colno})"))
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall(None, {}, 'a tool call must be {"name": <function-name>, "arguments": {...}}'))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the well-formed tool-call blocks, stripped; those calls) of an assistant
    reply: what an OpenAI-style server answers as `content` and `tool_calls`. A malformed block
    stays in the text, where the client can see it."""
    calls, kept = [], []
    for match in _TOOL_CALL.finditer(text):
        (call,) = parse_tool_calls(match.group(0))
        if call.error is None:
            calls.append(call)
            kept.append(match.span())
    rest, at = [], 0
    for start, end in kept:
        rest.append(text[at:start])
        at = end
    return "".join(rest + [text[at:]]).strip(), calls


class ToolCallStream:
    """split_tool_calls for a reply that arrives in pieces (serve's streaming): `feed` each piece,
    then `finish`; each returns events, ("content", text) or ("call", ToolCall), in order. Text
    goes out as soon as it cannot be part of a call: only a possible start of "<tool_call>" is held,
    a block until it closes, and whitespace until more content follows it (split_tool_calls strips
    the content). The content and calls of all events together are split_tool_calls' for the whole
    text (tested at every split); `max_calls` > 0 keeps only the first that many calls (the other
    well-formed blocks are dropped, as the one-call answer drops them)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int = 0):
        self.max_calls, self.calls = max_calls, 0
        self.pending = ""  # text not yet sent: a possible "<tool_call>" start, or an open block
        self.spaces = ""  # whitespace held until content follows it
        self.started = False  # content sent already (leading whitespace is dropped before that)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        events = []
        while self.pending:
            if self.pending.startswith(self.OPEN):
                end = self.pending.find(self.CLOSE)
                if end < 0:
                    break  # an open block: held until it closes (or the reply ends)
                end += len(self.CLOSE)
                block, self.pending = self.pending[:end], self.pending[end:]
                (call,) = parse_tool_calls(block)
                if call.error is not None:
                    events += self._content(block)  # malformed: stays in the text, as split_tool_calls keeps it
                elif not self.max_calls or self.calls < self.max_calls:
                    self.calls += 1
                    events.append(("call", call))
                else:
                    self.calls += 1  # past max_calls: dropped
                continue
            at = self.pending.find(self.OPEN)
            if at < 0:  # hold the longest end that could begin "<tool_call>"
                at = next((len(self.pending) - k for k in range(min(len(self.OPEN) - 1, len(self.pending)), 0, -1)
                           if self.OPEN.startswith(self.pending[-k:])), len(self.pending))
                if at == 0:
                    break
            text, self.pending = self.pending[:at], self.pending[at:]
            events += self._content(text)
        return events

    def finish(self) -> list[tuple[str, Any]]:
        """The rest: an unclosed block or a held "<tool_c" is content; trailing whitespace is dropped."""
        rest, self.pending = self.pending, ""
        return self._content(rest)

    def _content(self, text: str) -> list[tuple[str, Any]]:
        text = self.spaces + text
        body = text.rstrip()
        self.spaces = text[len(body):]
        if not self.started:
            body = body.lstrip()
        if not body:
            return []
        self.started = True
        return [("content", body)]


def format_tool_calls(calls: Sequence[ToolCall]) -> str:
    """Calls as an assistant turn writes them in Qwen's format (the inverse of parse_tool_calls):
    how a conversation's earlier calls are given back to the model."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}) + "\n</tool_call>"
                     for c in calls)
