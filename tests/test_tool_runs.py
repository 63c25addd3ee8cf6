"""How a round of tool calls runs (tools/runner.py): on threads of the trainer or in worker processes
(tools.processes), every failure an error result the model reads (unknown tools, bad
arguments, exceptions, sys.exit, exceptions whose message cannot be read, timeouts, crashes), the
same results in both modes, and results cut at tools.result_chars."""

import json
import time

import pytest

from vlforge.config import ConfigError, ToolsConfig
from vlforge.tools.calls import ToolCall
from vlforge.tools.registry import load_tools
from vlforge.tools.runner import ToolProcesses, run_tool_calls


def test_tool_results_report_every_failure_to_the_model_and_slow_tools_time_out(tmp_path):
    (tmp_path / "t.py").write_text(
        "import time\n"
        "def slow(seconds: float, mark: str = '') -> str:\n    '''Sleep.\n\n    Args:\n        seconds: How long.\n"
        "        mark: A file written after the sleep.\n    '''\n"
        "    time.sleep(seconds)\n    if mark:\n        open(mark, 'w').write('done')\n    return 'woke'\n\n"
        "def data(key: str) -> dict:\n    '''A record.\n\n    Args:\n        key: The key.\n    '''\n"
        "    return {'key': key, 'n': 1}\n")
    tools = load_tools(["calculator", f"{tmp_path / 't.py'}:slow", f"{tmp_path / 't.py'}:data"])
    calls = [[ToolCall("calculator", {"expression": "6*7"}), ToolCall("search", {"q": "x"})],
             [ToolCall("calculator", {"expr": "1"}), ToolCall("calculator", {"expression": "1/0"})],
             [ToolCall(None, {}, "the tool call is not valid JSON"), ToolCall("data", {"key": "a"})],
             [ToolCall("slow", {"seconds": 0.05}), ToolCall("slow", {"seconds": 5.0, "mark": str(tmp_path / "late")})]]
    results = run_tool_calls(calls, tools, timeout_s=1.0)
    assert not (tmp_path / "late").exists()  # the round did not wait for the 5 s call to end
    assert [[r.ok for r in seq] for seq in results] == [[True, False], [False, False], [False, True], [True, False]]
    assert results[0][0].text == "42" and "unknown tool 'search'" in results[0][1].text
    assert "TypeError" in results[1][0].text and "ZeroDivisionError" in results[1][1].text
    assert "not valid JSON" in results[2][0].text and json.loads(results[2][1].text) == {"key": "a", "n": 1}
    assert results[3][0].text == "woke" and "within 1 s" in results[3][1].text
    # every call starts at once (none waits for a free worker): 40 calls of 0.3 s all answer within 1 s
    many = run_tool_calls([[ToolCall("slow", {"seconds": 0.3})] for _ in range(40)], tools, timeout_s=1.0)
    assert all(seq[0].ok for seq in many)


def test_tool_processes_give_the_threads_results_and_stop_what_hangs_or_crashes(tmp_path):
    """tools.processes: the same results as threads in the trainer; a call past the timeout
    is stopped (its worker killed: it never writes its file), a worker that dies (os._exit) answers
    its call with an error and is replaced, a tool's print does not break the channel, and more calls
    than workers wait for a free one, each timed from its own start. A tool a worker cannot load
    stops the run with the reason."""
    (tmp_path / "t.py").write_text(
        "import os, time\n"
        "def slow(seconds: float, mark: str = '') -> str:\n    '''Sleep.\n\n    Args:\n        seconds: How long.\n"
        "        mark: A file written after the sleep.\n    '''\n"
        "    print('sleeping', seconds)\n    time.sleep(seconds)\n"
        "    if mark:\n        open(mark, 'w').write('done')\n    return 'woke'\n\n"
        "def crash(code: int) -> str:\n    '''Exit at once.\n\n    Args:\n        code: The exit code.\n    '''\n"
        "    os._exit(code)\n\n"
        "def pid(seconds: float) -> str:\n    '''Sleep, then say which process ran the call.\n\n    Args:\n"
        "        seconds: How long.\n    '''\n    time.sleep(seconds)\n    return str(os.getpid())\n")
    tools = load_tools(["calculator"] + [f"{tmp_path / 't.py'}:{name}" for name in ("slow", "crash", "pid")])
    calls = [[ToolCall("calculator", {"expression": "6*7"}), ToolCall("search", {"q": "x"})],
             [ToolCall("calculator", {"expression": "1/0"}), ToolCall(None, {}, "the tool call is not valid JSON")],
             [ToolCall("slow", {"seconds": 0.05})]]
    mark = tmp_path / "hung-finished"
    with ToolProcesses(tools, 3) as run:
        assert run(calls, tools, 30.0) == run_tool_calls(calls, tools, 30.0)
        [[hung], [died], [fine]] = run([[ToolCall("slow", {"seconds": 3.0, "mark": str(mark)})],
                                        [ToolCall("crash", {"code": 3})], [ToolCall("calculator", {"expression": "2"})]],
                                       tools, 1.0)
        assert not mark.exists()  # the round did not wait for the 3 s call to end
        assert not hung.ok and "within 1 s (stopped)" in hung.text
        assert not died.ok and "exit code 3" in died.text and fine.text == "2"
        assert [r.text for [r] in run([[ToolCall("calculator", {"expression": "3"})]] * 5, tools, 5.0)] == ["3"] * 5
        # 6 calls of 0.4 s on 3 workers: two waves (a call waits for a free worker, each answered inside its
        # own 1 s), every one on one of the 3 workers
        waves = run([[ToolCall("pid", {"seconds": 0.4})]] * 6, tools, 1.0)
        assert all(r.ok for [r] in waves) and len({r.text for [r] in waves}) == 3
    time.sleep(3.5)
    assert not mark.exists()  # the hung call's worker was killed, not left running
    (tmp_path / "t.py").write_text("raise ImportError('gone')\n")  # changed after the trainer loaded it
    with ToolProcesses(tools, 1) as run, pytest.raises(ConfigError, match="worker process .* could not load .*gone"):
        run([[ToolCall("calculator", {"expression": "1"})]], tools, 5.0)


STRANGE_TOOLS = '''
import sys


class Unreadable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


class Stop(BaseException):
    pass


def leave(code: int) -> str:
    """Exit the interpreter.

    Args:
        code: The exit code.
    """
    sys.exit(code)


def odd() -> str:
    """Raise an exception whose message cannot be read."""
    raise Unreadable()


def halt() -> str:
    """Raise a BaseException that is no Exception."""
    raise Stop("halted")


def dump(n: int, fail: bool = False) -> str:
    """Return (or raise with) n characters.

    Args:
        n: How many.
        fail: Raise them as an error's message instead.
    """
    if fail:
        raise ValueError("y" * n)
    return "x" * n
'''


@pytest.mark.parametrize("processes", [0, 1])
def test_a_tool_that_exits_or_whose_error_cannot_be_read_is_answered_with_its_error(tmp_path, processes):
    """A tool that calls sys.exit, raises a BaseException that is no Exception, or raises an exception
    whose __str__ raises: each call answers with its error (not, on a thread, "did not answer within
    the timeout" after waiting all of it; not, in a worker, its process's end), the same in both modes."""
    (tmp_path / "t.py").write_text(STRANGE_TOOLS)
    tools = load_tools([f"{tmp_path / 't.py'}:{name}" for name in ("leave", "odd", "halt")] + ["calculator"])
    calls = [[ToolCall("leave", {"code": 3})], [ToolCall("odd", {})],
             [ToolCall("halt", {}), ToolCall("leave", {"code": 0})]]
    want = [["error: SystemExit: 3"], ["error: Unreadable: <its message could not be read: RuntimeError>"],
            ["error: Stop: halted", "error: SystemExit: 0"]]
    if processes:
        with ToolProcesses(tools, processes) as run:
            results = run(calls, tools, 10.0)
            # the worker that caught SystemExit goes on serving
            assert run([[ToolCall("calculator", {"expression": "6*7"})]], tools, 30.0)[0][0].text == "42"
    else:
        results = run_tool_calls(calls, tools, timeout_s=10.0)
    assert [[r.text for r in seq] for seq in results] == want
    assert not any(r.ok for seq in results for r in seq)


@pytest.mark.parametrize("processes", [0, 1])
def test_a_huge_tool_result_is_cut_with_a_note_and_a_warning(tmp_path, tiny, processes):
    """A 10 MB result (or error message) comes back cut at tools.result_chars (the default when
    none is given), with a note the model reads saying how much the tool returned, and a warning; a
    result within the bound is untouched. The setting reaches both runners through tool_runner."""
    from vlforge.data.encode import Encoder, ImageLimits
    from vlforge.rollout.multiturn import tool_runner

    (tmp_path / "t.py").write_text(STRANGE_TOOLS)
    tools = load_tools([f"{tmp_path / 't.py'}:dump"])
    big, small = ToolCall("dump", {"n": 10_000_000}), ToolCall("dump", {"n": 10})
    cfg = ToolsConfig(names=[f"{tmp_path / 't.py'}:dump"], result_chars=1000, processes=processes)
    with tool_runner(tools, cfg) as run, pytest.warns(UserWarning) as caught:
        [[cut, kept], [error]] = run([[big, small], [ToolCall("dump", {"n": 5000, "fail": True})]], tools, 30.0)
    note = "(cut: the tool returned 10,000,000 characters; the first 1,000 follow)\n"
    assert cut.ok and cut.text == note + "x" * 1000 and cut.cut == 10_000_000 - 1000
    assert kept.ok and kept.text == "x" * 10 and kept.cut == 0
    assert not error.ok and error.cut == 5019 - 1000
    cause = "error: ValueError: " + "y" * 981
    assert error.text == "(cut: the tool returned 5,019 characters; the first 1,000 follow)\n" + cause
    assert sorted(str(w.message) for w in caught) == [
        f"vlforge: tool 'dump' returned {n} characters; cut to tools.result_chars=1,000, with a note the "
        "model reads" for n in ("10,000,000", "5,019")]
    # without a bound given, tools.result_chars' default applies
    with pytest.warns(UserWarning, match="cut to tools.result_chars=65,536"):
        [[default]] = run_tool_calls([[big]], tools, 30.0)
    assert default.text == note.replace("1,000", "65,536") + "x" * 65536 and default.cut == 10_000_000 - 65536
    # what the model reads of it: the note, first in its tool message, whatever the token cut keeps
    _, processor = tiny
    shown = processor.tokenizer.decode(Encoder(processor, ImageLimits(1024, 4096)).tool_turn_ids([cut.text], 96))
    assert "<tool_response>\n" + note + "xx" in shown and shown.count("x") < 200 and "(cut)" in shown
