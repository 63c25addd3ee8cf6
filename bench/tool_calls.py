"""What a round of GRPO tool calls costs: threads in the trainer (tools.processes: 0) against
worker processes (tools.processes: N, tools/runner.ToolProcesses), same process, same calls.

    python bench/tool_calls.py [--calls 64] [--workers 8,16] [--repeats 5]

Rounds of `calls` calls of two tools: the builtin calculator (microseconds of work: the round is
pure overhead) and a tool that sleeps 50 ms (I/O-bound, like an API). Processes are timed warm
(their workers started by a first round, as after a run's first rollout); the first round, which
starts them, is reported apart. Prints one JSON line per case, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from vlforge.tools.calls import ToolCall

from vlforge.tools.registry import load_tools

from vlforge.tools.runner import ToolProcesses, run_tool_calls

SLEEPER = ("import time\n"
           "def wait(ms: int) -> str:\n    '''Sleep.\n\n    Args:\n        ms: Milliseconds.\n    '''\n"
           "    time.sleep(ms / 1000)\n    return 'ok'\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--workers", default="8,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sleeper.py").write_text(SLEEPER)
        tools = load_tools(["calculator", f"{Path(tmp) / 'sleeper.py'}:wait"])
        rounds = {"calculator": [[ToolCall("calculator", {"expression": f"{i} * 7 + 1"})] for i in range(args.calls)],
                  "sleep 50 ms": [[ToolCall("wait", {"ms": 50})] for _ in range(args.calls)]}
        rows = []

        def timed(run, calls) -> list[float]:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                results = run(calls, tools, 60.0)
                times.append(time.perf_counter() - start)
                assert all(r.ok for seq in results for r in seq), results
            return times

        for tool, calls in rounds.items():
            rows.append({"tool": tool, "runner": "threads", "calls": args.calls,
                         "round_ms": 1000 * statistics.median(timed(run_tool_calls, calls))})
            for n in map(int, args.workers.split(",")):
                with ToolProcesses(tools, n) as run:
                    start = time.perf_counter()
                    run(calls, tools, 60.0)  # starts the workers
                    first = time.perf_counter() - start
                    rows.append({"tool": tool, "runner": f"{n} processes", "calls": args.calls,
                                 "round_ms": 1000 * statistics.median(timed(run, calls)), "first_round_ms": 1000 * first})
    for row in rows:
        print(json.dumps(row))
    print(f"\n| tool | runner | {args.calls} calls, median round | first round (starts the workers) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        first = f"{r['first_round_ms']:.0f} ms" if "first_round_ms" in r else "-"
        print(f"| {r['tool']} | {r['runner']} | {r['round_ms']:.1f} ms | {first} |")


if __name__ == "__main__":
    main()
