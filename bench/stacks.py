"""Run `python -m MODULE ARGS...` and append the main thread's Python stack to FILE every SECONDS.

Where a slow or silent run spends its time, without a profiler on the device machine (py-spy is
not installed there). A daemon thread reads sys._current_frames() under the GIL: faulthandler's
dump_traceback_later was tried first and crashed a run that was compiling (it walks the frames
without the GIL).
    python3 bench/stacks.py OUT/stacks.txt 20 vlforge grpo configs/qwen3vl-2b-grpo.yaml ...
"""

import runpy
import sys
import threading
import time
import traceback


def sample(path: str, seconds: float, main_id: int) -> None:
    start = time.perf_counter()
    while True:
        time.sleep(seconds)
        frame = sys._current_frames().get(main_id)
        if frame is None:
            return
        frames = traceback.extract_stack(frame)
        # the project's own frames (where in vlforge) and the innermost ones (what it is doing there)
        keep = [f for f in frames[:-8] if "/vlforge/" in f.filename or "/bench/" in f.filename] + frames[-8:]
        stack = "".join(traceback.format_list(keep))
        with open(path, "a") as sink:
            sink.write(f"--- {time.perf_counter() - start:.0f} s\n{stack}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python3 bench/stacks.py FILE SECONDS MODULE [ARGS...]")
    path, seconds, module = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    threading.Thread(target=sample, args=(path, seconds, threading.get_ident()), daemon=True).start()
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
