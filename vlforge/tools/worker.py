"""One tool worker process (tools/runner.ToolProcesses starts it): `python -m vlforge.tools.worker`.

It reads frames from stdin and writes frames to the stdout it was started with; a frame is an
8-byte length and a pickle. The first frame holds the tools as (name, spec) pairs, loaded here from
their specs (a builtin name or ``path.py:function``, as tools.names names them); each next frame
is answered with None once they are loaded (or with the error that stopped it); each next frame
holds one ToolCall, the prompt's images it may take and the most characters of its result's text
(tools.result_chars), answered with its ToolResult (tools/runner._run_one: an error the model
can read when the call fails, the text cut here, before the pipe). A None frame or the end of
stdin ends it. A tool's own prints go to stderr: stdout carries only frames. Imports no torch (rl/__init__.py loads its names lazily): a worker
starts in well under a second.
"""

from __future__ import annotations

import os
import signal
import sys

from vlforge.tools.registry import Tool, tool_function

from vlforge.tools.runner import _run_one, read_frame, write_frame


def main() -> None:
    # Ctrl-C reaches every process of the terminal's group, a scheduler's SIGTERM every process of the
    # job: a trainer finishing its step on either (train/stop.py) still needs its calls answered. It
    # ends this worker itself: the end of stdin, or SIGKILL at a call's timeout.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the protocol's channel
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a tool's print() goes to stderr
    inbox = sys.stdin.buffer
    try:
        try:
            tools = {name: Tool(name, tool_function(spec), {}, spec) for name, spec in read_frame(inbox)}
        except Exception as e:  # noqa: BLE001 - said to the trainer, which stops the run with it
            write_frame(frames, f"{type(e).__name__}: {e}")
            return
        write_frame(frames, None)  # ready: a call's timeout starts after this, not with the interpreter
        while (frame := read_frame(inbox)) is not None:
            call, images, max_chars = frame
            write_frame(frames, _run_one(call, tools, images, max_chars))
    except EOFError:
        pass  # the trainer closed our stdin (or died): nothing left to answer


if __name__ == "__main__":
    main()
