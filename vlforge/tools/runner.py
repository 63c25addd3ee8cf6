"""How a tool call runs: its result (the function's return value as text and images, or an error
the model can read: unknown tool, bad arguments, an exception, a timeout), its text cut at the
configured bound with a note saying so; calls run on threads (run_tool_calls) or in worker
processes (ToolProcesses, tools/worker.py), each with a timeout. The rollout loop that uses them is
rollout/multiturn.py.
"""

from __future__ import annotations

import json
import pickle
import selectors
import struct
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import BinaryIO, Sequence

from PIL import Image

from vlforge.config import ToolsConfig
from vlforge.tools.calls import ToolCall
from vlforge.tools.registry import IMAGES_ARGUMENT, Tool


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool
    images: tuple[Image.Image, ...] = ()  # RGB images the tool returned: shown to the model before the text
    cut: int = 0  # characters of the text cut off past tools.result_chars (a note in the text says so)


MAX_RESULT_CHARS = ToolsConfig.result_chars  # the default bound of a result's text


def _run_one(call: ToolCall, tools: dict[str, Tool], images: Sequence[Image.Image] = (),
             max_chars: int = MAX_RESULT_CHARS) -> ToolResult:
    """One call's result, its text cut at `max_chars`; `images` (the prompt's) go to a tool that takes them."""
    result = _answer(call, tools, images)
    if len(result.text) <= max_chars:
        return result
    # cut here, where the call returns (in a worker, before the pipe): a tool that returns megabytes
    # costs neither the trainer's memory nor the tokenizer's time. The note goes first, so that the model
    # reads it whatever tools.result_tokens then keeps of the text
    note = f"(cut: the tool returned {len(result.text):,} characters; the first {max_chars:,} follow)\n"
    return replace(result, text=note + result.text[:max_chars], cut=len(result.text) - max_chars)


def _answer(call: ToolCall, tools: dict[str, Tool], images: Sequence[Image.Image]) -> ToolResult:
    if call.error is not None:
        return ToolResult(f"error: {call.error}", False)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(tools)}", False)
    try:
        arguments = dict(call.arguments)
        if tool.takes_images:
            # the rollout's images, whatever the model wrote under that name; copies, so that a tool that
            # draws on them changes no other call's
            arguments[IMAGES_ARGUMENT] = [im.copy() for im in images]
        return _result(tool.fn(**arguments))
    except KeyboardInterrupt:  # the user's Ctrl-C stops the run (a worker process's too), never a tool result
        raise
    # the model reads what went wrong, as it would from a real API; SystemExit and other BaseExceptions
    # included: on a thread, one escaping would end the thread unanswered (reported as a timeout)
    except BaseException as e:  # noqa: BLE001
        return ToolResult(f"error: {describe_exception(e)}", False)


def describe_exception(e: BaseException) -> str:
    """`Type: message` of an exception, even one whose __str__ raises (its message then said unreadable)."""
    try:
        message = str(e)
    except BaseException as inner:  # noqa: BLE001 - a tool's own exception class may be broken
        message = f"<its message could not be read: {type(inner).__name__}>"
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


MAX_ASPECT = 200  # the widest image Qwen3-VL's processor takes (smart_resize's limit)


def _result(value) -> ToolResult:
    """A tool's return value as the model reads it: text (a string as it is, anything else as JSON or
    str), and images (a PIL image, or the images of a list of text and images), loaded here as RGB
    copies (an image over a file the tool closed is read before it returns). An image the processor
    cannot take raises (an error result)."""
    parts = list(value) if isinstance(value, (list, tuple)) else [value]
    try:
        images = [v.convert("RGB") for v in parts if isinstance(v, Image.Image)]
    except (AssertionError, ValueError, OSError) as e:  # PIL's, for a lazily opened file already closed
        raise ValueError(f"the tool returned an image it cannot read any more ({type(e).__name__}: {e}); a tool "
                         "that opens an image file must load it (im.load() or im.copy()) before closing it") from None
    for im in images:
        w, h = im.size
        if min(w, h) < 1 or max(w, h) > MAX_ASPECT * min(w, h):
            raise ValueError(f"the tool returned a {w}x{h} image; images must be at least 1x1 pixels and at "
                             f"most {MAX_ASPECT}:1")
    if not images:
        parts = [value]  # a list without images is a value of its own: JSON
    texts = [_text(v) for v in parts if not isinstance(v, Image.Image)]
    return ToolResult("\n".join(texts), True, tuple(images))


def _text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def run_tool_calls(calls: Sequence[Sequence[ToolCall]], tools: dict[str, Tool], timeout_s: float,
                   images: Sequence[Sequence[Image.Image]] | None = None,
                   max_chars: int = MAX_RESULT_CHARS) -> list[list[ToolResult]]:
    """Every sequence's calls, each on a thread of its own, all started at once (tools that wait on
    I/O overlap; none waits in a queue, so each has the whole `timeout_s`); a call still running then
    gets a timeout error. Python cannot stop a thread: a tool that never returns keeps running, but
    on a daemon thread, so it does not hold the process at exit (concurrent.futures' pools join
    their threads at exit, hence plain threads here). A tool that holds the GIL in one long C call
    delays everything: tools should bound their own work. `images[i]`: the images sequence i's
    prompt holds, for tools that take them; `max_chars`: tools.result_chars."""
    flat = [(i, j, call) for i, seq in enumerate(calls) for j, call in enumerate(seq)]
    box: dict[tuple[int, int], ToolResult] = {}

    def run(i: int, j: int, call: ToolCall) -> None:
        try:
            box[i, j] = _run_one(call, tools, images[i] if images is not None else (), max_chars)
        except BaseException as e:  # noqa: BLE001 - _run_one answers a tool's errors; a thread never ends unanswered
            box[i, j] = ToolResult(f"error: the call failed ({describe_exception(e)})", False)

    threads = [threading.Thread(target=run, args=(i, j, call), name="vlforge-tool", daemon=True)
               for i, j, call in flat]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = ToolResult(f"error: the tool did not answer within {timeout_s:g} s", False)
    return _warn_cut([[box.get((i, j), late) for j in range(len(seq))] for i, seq in enumerate(calls)], calls,
                     max_chars)


def _warn_cut(results: list[list[ToolResult]], calls: Sequence[Sequence[ToolCall]],
              max_chars: int) -> list[list[ToolResult]]:
    """`results`, after a warning for each one cut at `max_chars` (tools.result_chars)."""
    for seq, answers in zip(calls, results):
        for call, result in zip(seq, answers):
            if result.cut:
                warnings.warn(f"vlforge: tool {call.name!r} returned {max_chars + result.cut:,} characters; cut to "
                              f"tools.result_chars={max_chars:,}, with a note the model reads", stacklevel=3)
    return results


_FRAME_HEADER = struct.Struct("<Q")  # a frame between the trainer and a tool worker: its length, then a pickle


def write_frame(stream: BinaryIO, value) -> None:
    data = pickle.dumps(value)
    stream.write(_FRAME_HEADER.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO):
    """The next frame's value; EOFError at the end of the stream (also in the middle of a frame)."""
    header = stream.read(_FRAME_HEADER.size)
    if len(header) < _FRAME_HEADER.size:
        raise EOFError
    (size,) = _FRAME_HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


class ToolProcesses:
    """Tool calls in worker processes (tools.processes = N > 0), for tools that must not run in
    the trainer: a call still running at the timeout is stopped (its worker killed, a new one
    started when needed), and a tool that holds the GIL, leaks memory or crashes its interpreter (a
    C extension's segfault) affects its worker only. Workers are `python -m vlforge.tools.worker`
    (tools/worker.py) subprocesses: a fresh interpreter, none of the trainer's CUDA state or
    threads, and no multiprocessing start method that would import the trainer's __main__ again.
    Each loads the tools from their specs once and is reused across rounds. Up to N calls run at
    once; the others wait for a free worker, and each call has `timeout_s` from its own start.
    Isolation from the trainer, not a sandbox: a worker runs as the trainer's user.

        with ToolProcesses(tools, 8) as run:
            results = run(calls, tools, timeout_s)   # run_tool_calls' signature and results
    """

    def __init__(self, tools: dict[str, Tool], processes: int, max_chars: int = MAX_RESULT_CHARS):
        missing = [t.name for t in tools.values() if not t.spec]
        if missing:
            raise ValueError(f"tools {missing} have no spec to load in a worker process (load them with load_tools)")
        self.specs = [(t.name, t.spec) for t in tools.values()]
        self.processes, self.max_chars = processes, max_chars  # a worker cuts each result's text at max_chars
        self.idle: list = []  # started workers waiting for a call

    def _start(self, count: int = 1) -> list:
        """`count` new workers, started together, once each has loaded the tools (a call's timeout
        does not pay for an interpreter's start)."""
        procs = [subprocess.Popen([sys.executable, "-m", "vlforge.tools.worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE) for _ in range(count)]
        problems = []
        for proc in procs:
            write_frame(proc.stdin, self.specs)
        for proc in procs:
            try:
                problems.append(read_frame(proc.stdout))
            except EOFError:
                problems.append(f"it ended (exit code {proc.wait()})")
        if problem := next((p for p in problems if p is not None), None):
            for proc in procs:
                self._stop(proc)
            from vlforge.config import ConfigError  # the run stops with the reason, as for a bad key

            raise ConfigError(f"tools.names: a worker process (tools.processes) could not load "
                              f"{[spec for _, spec in self.specs]}: {problem}")
        return procs

    @staticmethod
    def _stop(proc) -> None:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            stream.close()

    def __call__(self, calls: Sequence[Sequence[ToolCall]], tools: dict[str, Tool], timeout_s: float,
                 images: Sequence[Sequence[Image.Image]] | None = None) -> list[list[ToolResult]]:
        def frame(i: int, call: ToolCall) -> tuple:  # the prompt's images go only to a tool that takes them
            tool = tools.get(call.name) if call.error is None else None
            takes = images is not None and tool is not None and tool.takes_images
            return call, list(images[i]) if takes else [], self.max_chars

        waiting = [(i, j, call) for i, seq in enumerate(calls) for j, call in enumerate(seq)][::-1]
        box: dict[tuple[int, int], ToolResult] = {}
        busy = {}  # worker -> (call's key, deadline)
        self.idle += self._start(max(0, min(len(waiting), self.processes) - len(self.idle)))
        try:
            with selectors.DefaultSelector() as selector:
                while waiting or busy:
                    while waiting and len(busy) < self.processes:
                        i, j, call = waiting.pop()
                        proc = self.idle.pop() if self.idle else self._start()[0]
                        try:
                            write_frame(proc.stdin, frame(i, call))
                        except (BrokenPipeError, OSError):  # the worker ended while idle: another one takes it
                            self._stop(proc)
                            waiting.append((i, j, call))
                            continue
                        busy[proc] = ((i, j), time.monotonic() + timeout_s)
                        selector.register(proc.stdout, selectors.EVENT_READ, proc)
                    first_deadline = min(deadline for _, deadline in busy.values())
                    for key, _ in selector.select(max(0.0, first_deadline - time.monotonic())):
                        proc = key.data
                        selector.unregister(proc.stdout)
                        where, _ = busy.pop(proc)
                        try:
                            box[where] = read_frame(proc.stdout)
                            self.idle.append(proc)
                        except (EOFError, OSError, pickle.UnpicklingError):
                            try:
                                code = proc.wait(timeout=1.0)  # its stdout closed as it ended: the exit code follows
                            except subprocess.TimeoutExpired:
                                code = None
                            self._stop(proc)
                            box[where] = ToolResult(f"error: the tool's process ended without an answer (exit code "
                                                    f"{code})", False)
                    now = time.monotonic()
                    for proc, (where, deadline) in list(busy.items()):
                        if deadline <= now:  # stopped: its worker killed, the call answered with the timeout
                            selector.unregister(proc.stdout)
                            busy.pop(proc)
                            self._stop(proc)
                            box[where] = ToolResult(f"error: the tool did not answer within {timeout_s:g} s (stopped)",
                                                    False)
        finally:  # an error or an interrupt mid-round: no worker is left running a call
            for proc in busy:
                self._stop(proc)
        return _warn_cut([[box[i, j] for j in range(len(seq))] for i, seq in enumerate(calls)], calls, self.max_chars)

    def close(self) -> None:
        for proc in self.idle:
            try:
                proc.stdin.close()  # the worker's read ends: it exits
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001 - a worker that does not leave is killed
                pass
            self._stop(proc)
        self.idle = []

    def __enter__(self) -> "ToolProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
