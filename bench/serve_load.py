"""`vlforge serve` under load: requests/s, latency and time to first token at 1, 8 and 32 clients.

    python bench/serve_load.py --preset qwen3vl-2b --out serve_load.json          # on a GPU machine
    python bench/serve_load.py --preset tiny --device cpu --requests 2 --new-tokens 4 16 --image-size 64
                                                                                  # smoke run (proves it works)

Starts `vlforge serve PRESET` (random weights) as its own process on a free loopback port, waits
for /health, warms it up (one batch of full-length requests), then for each concurrency level
runs that many clients at once, first one untimed request each (the graphs of the level's slot and
length buckets captured: the steady state of a running server), then, timed, each sending
`--requests` streamed chat completions one after another. Requests alternate between the short and the long `--new-tokens` (min_tokens = max_tokens:
random weights would otherwise stop at random points), each with its own synthetic image (distinct
colours: no two share vision features) unless `--image-size 0`. Latency is from sending the
request to its last byte; time to first token (TTFT) to its first streamed text; both measured by
the client. The server's own /metrics gives the mean batch size of each level.

Prints a table, then the whole report as one JSON line (also written to --out). `--serve-arg`
passes extra flags to `vlforge serve` (to compare settings on the same workload); a value holding
spaces is split like a shell line:

    python bench/serve_load.py --preset qwen3vl-2b --out compiled.json         # serve's default: compiled
    python bench/serve_load.py --preset qwen3vl-2b --serve-arg=--no-compile --out eager.json

`mean_batch` is the server's vlforge_batch_size histogram: requests joining the running batch
together; `max_running` (from /health) is the most requests generating at once so far.

Where the time goes: `--in-process` runs the same workload through the InferenceModel's pull API
without a server (the engine's bound; `engine_steps`, `prefills`, `prefill_s`, `decode_s` per level),
`--engine-set` adds variants of the engine's settings in the same process, `--trace PATH` profiles one
short level (`gpu_busy_share`; busiest kernels and host ops in PATH); `--server-switch-interval`
sets the server's GIL hand-over interval for an A/B:

    python bench/serve_load.py --preset qwen3vl-2b --in-process --clients 8 32 --trace trace.txt \
        --engine-set sync_every=8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vlforge.cli", "serve", args.preset, "--device", args.device, "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-tokens-limit", str(max(args.new_tokens)),
           *[a for arg in args.serve_arg for a in shlex.split(arg)]]
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VLFORGE_API_KEY", None)  # the benchmark's server takes no key
    if args.server_switch_interval is not None:  # an A/B of the server's GIL hand-over interval (sys.setswitchinterval)
        site = Path(log.name).parent / "switch"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import sys\nsys.setswitchinterval({args.server_switch_interval})\n")
        env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")


def image(size: int, seed: int) -> Image.Image:
    color = ((seed * 37) % 256, (seed * 91 + 40) % 256, (seed * 53 + 90) % 256)
    im = Image.new("RGB", (size, size), color)
    im.paste((255 - color[0], 255 - color[1], 255 - color[2]), (size // 4, size // 4, size // 2, size // 2))
    return im


def image_url(size: int, seed: int) -> str | None:
    if size <= 0:
        return None
    im = image(size, seed)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def payload(args, n_tokens: int, seed: int) -> dict:
    content: list[dict] = [{"type": "text", "text": f"Request {seed}: describe the picture in detail."}]
    if (url := image_url(args.image_size, seed)) is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return {"messages": [{"role": "user", "content": content}], "max_tokens": n_tokens, "min_tokens": n_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, body: dict) -> dict:
    start = time.perf_counter()
    first, usage, status = None, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                status = 500
            elif event.get("usage"):
                usage = event["usage"]
            elif first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"status": status, "latency_s": end - start, "ttft_s": None if first is None else first - start,
            "completion_tokens": (usage or {}).get("completion_tokens", 0), "max_tokens": body["max_tokens"]}


async def run_level(url: str, args, clients: int, seed0: int) -> dict:
    short, long_ = min(args.new_tokens), max(args.new_tokens)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        # every body made before the clock starts: a PNG encoded in the clients' event loop would delay
        # the other clients' reads (their time to first token)
        bodies = [[payload(args, short if (c + k) % 2 == 0 else long_, seed0 + c * args.requests + k)
                   for k in range(args.requests)] for c in range(clients)]

        async def worker(c: int) -> list[dict]:
            return [await one_request(client, b) for b in bodies[c]]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    return summarize(results, wall, clients, short, long_)


def summarize(results: list[dict], wall: float, clients: int, short: int, long_: int) -> dict:
    ok = [r for r in results if r["status"] == 200]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]

    def pct(xs, q):
        return round(float(np.percentile(xs, q)), 4) if xs else None

    def by_length(n):
        return pct([r["latency_s"] for r in ok if r["max_tokens"] == n], 50)

    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 3),
            "requests_per_s": round(len(ok) / wall, 3),
            "completion_tokens_per_s": round(sum(r["completion_tokens"] for r in ok) / wall, 1),
            "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "streamed_text": len(ttft),  # the requests TTFT is taken from: those whose stream carried text
            f"latency_p50_s_{short}_tokens": by_length(short), f"latency_p50_s_{long_}_tokens": by_length(long_)}


def in_process_level(vlm, args, clients: int, seed0: int) -> dict:
    """The level's workload straight through the InferenceModel's pull API, no HTTP (--in-process): a
    closed loop of `clients` each with one request in flight (its next added as its last finishes),
    prepared and added on this one thread (the server prepares a prompt in the request's worker
    thread, beside the engine's). Times run from the add, so this is the engine's bound for the
    server: what HTTP, the event loop and the threads' shared GIL cost is the gap to the served
    numbers. Adds the engine's own counts."""
    from vlforge.infer.model import Request

    short, long_ = min(args.new_tokens), max(args.new_tokens)

    def request(c: int, k: int) -> Request:
        n, seed = short if (c + k) % 2 == 0 else long_, seed0 + c * args.requests + k
        content = [{"type": "text", "text": f"Request {seed}: describe the picture in detail."}]
        images = [image(args.image_size, seed)] if args.image_size > 0 else []
        if images:
            content.insert(0, {"type": "image"})
        return Request([{"role": "user", "content": content}], images=images, max_new_tokens=n, min_new_tokens=n)

    todo = [[request(c, k) for k in range(args.requests)] for c in range(clients)]
    engine = vlm.gen_engine()
    live: dict[int, dict] = {}  # engine id -> its timing record
    results: list[dict] = []
    steps = prefills = 0
    prefill_s = decode_s = 0.0

    def add(c: int) -> None:
        if todo[c]:
            r = todo[c].pop(0)
            live[vlm.add(r)] = {"client": c, "start": time.perf_counter(), "first": None,
                                "max_tokens": r.max_new_tokens}

    start = time.perf_counter()
    for c in range(clients):
        add(c)
    while live:
        stats = engine.stats
        before = (stats.prefills, stats.prefill_s, stats.decode_s)
        outputs = vlm.step()
        steps += 1
        if engine.stats is not stats:  # a new batch started (the engine had drained): its stats are new
            before = (0, 0.0, 0.0)
        prefills += engine.stats.prefills - before[0]
        prefill_s += engine.stats.prefill_s - before[1]
        decode_s += engine.stats.decode_s - before[2]
        now = time.perf_counter()
        for o in outputs:
            rec = live[o.id]
            if o.text and rec["first"] is None:
                rec["first"] = now
            if o.completion is not None:
                del live[o.id]
                results.append({"status": 200, "latency_s": now - rec["start"], "ttft_s": rec["first"] - rec["start"],
                                "completion_tokens": o.completion.completion_tokens, "max_tokens": rec["max_tokens"]})
                add(rec["client"])
    level = summarize(results, time.perf_counter() - start, clients, short, long_)
    level.update(engine_steps=steps, prefills=prefills, prefill_s=round(prefill_s, 3), decode_s=round(decode_s, 3),
                 requests_per_prefill=round(len(results) / max(1, prefills), 2))
    return level


def run_in_process(args) -> tuple[list[dict], float]:
    """Every level through the InferenceModel in this process, loaded and warmed as `vlforge serve` does."""
    from vlforge.infer.model import InferenceModel

    started = time.perf_counter()
    vlm = InferenceModel.load(args.preset, device=args.device, compile=args.device != "cpu")
    vlm.warm_up(args.max_batch)
    vlm.open(args.max_batch)
    startup_s = time.perf_counter() - started
    engine, one = vlm.gen_engine(), argparse.Namespace(**{**vars(args), "requests": 1})
    in_process_level(vlm, one, min(4, max(args.clients)), 10**6)
    levels, seed, built = [], 0, {}
    for variant in ["", *args.engine_set]:  # the engine as built, then each variant of it
        for setting in filter(None, variant.split(",")):
            name, _, value = setting.partition("=")
            if not hasattr(engine, name):
                raise SystemExit(f"--engine-set {setting}: the Engine has no attribute {name!r}")
            built.setdefault(name, getattr(engine, name))
            setattr(engine, name, int(value))
        for clients in args.clients:
            in_process_level(vlm, one, clients, 10**7)
            levels.append(in_process_level(vlm, args, clients, seed))
            levels[-1]["variant"] = variant or "as built"
            seed += clients * args.requests
            print(json.dumps(levels[-1]), file=sys.stderr, flush=True)  # kept should a later level not finish
    if args.trace:  # one request a client at the most clients, as built: the profiler slows every op
        for name, value in built.items():
            setattr(engine, name, value)
        levels.append(traced(args.trace, lambda: in_process_level(vlm, one, max(args.clients), 10**8)))
        levels[-1]["variant"] = "as built, profiled"
    return levels, startup_s


def traced(path: str, run):
    """run() under torch's profiler: the share of the wall time the GPU ran kernels, and the busiest
    kernels and host ops, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        level = run()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu_s = sum(e.self_device_time_total for e in events) / 1e6
    level["gpu_busy_share"] = round(gpu_s / wall, 3)
    with open(path, "w") as f:
        f.write(f"wall {wall:.3f} s, GPU kernels {gpu_s:.3f} s (busy share {gpu_s / wall:.3f})\n\n")
        f.write(events.table(sort_by="self_device_time_total", row_limit=25) + "\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    return level


def batch_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    return samples.get("vlforge_batch_size_sum", 0.0), samples.get("vlforge_batch_size_count", 0.0)


def table(levels: list[dict]) -> str:
    cols = ["clients", "requests", "errors", "requests_per_s", "completion_tokens_per_s", "latency_p50_s",
            "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "streamed_text", "mean_batch", "max_running",
            "engine_steps", "prefills", "prefill_s", "decode_s", "gpu_busy_share", "variant"]
    cols += [k for k in levels[0] if k.startswith("latency_p50_s_")] if levels else []  # short vs long answers
    rows = [cols] + [[str(level.get(c)) for c in cols] for level in levels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def _engine_of(serve_args: list[str]) -> str:
    words = [a for arg in serve_args for a in shlex.split(arg)]
    for i, w in enumerate(words):
        if w == "--engine" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--engine="):
            return w.split("=", 1)[1]
    return "vlforge"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3vl-2b", help="a vlforge preset (random weights) or a model directory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels")
    ap.add_argument("--requests", type=int, default=4, help="requests each client sends, one after another")
    ap.add_argument("--new-tokens", type=int, nargs=2, default=[32, 256], metavar=("SHORT", "LONG"),
                    help="the two answer lengths requests alternate between")
    ap.add_argument("--image-size", type=int, default=448, help="side of each request's image; 0: text only")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `vlforge serve` arguments (repeatable; split like a shell line), "
                                                                  "e.g. \"--no-compile\"")
    ap.add_argument("--startup-timeout-s", type=float, default=900)
    ap.add_argument("--timeout-s", type=float, default=1800, help="per request")
    ap.add_argument("--server-switch-interval", type=float, default=None, metavar="S",
                    help="the server's sys.setswitchinterval (Python's default 0.005 s): how long a thread "
                         "waiting for the GIL waits before it asks for it")
    ap.add_argument("--in-process", action="store_true",
                    help="no server: the same workload through the InferenceModel's pull API (in_process_level)")
    ap.add_argument("--engine-set", action="append", default=[], metavar="NAME=INT[,NAME=INT]",
                    help="--in-process: after the levels as built, again with these Engine attributes set "
                         "(repeatable: each a variant, applied on top of the ones before; e.g. sync_every=8)")
    ap.add_argument("--trace", metavar="PATH", help="--in-process: then one request a client at the most clients "
                    "under torch's profiler, the engine as built (GPU busy share; busiest kernels and host ops to PATH)")
    ap.add_argument("--out", help="write the JSON report here too")
    args = ap.parse_args()
    if args.in_process:
        levels, startup_s = run_in_process(args)
        report = {"preset": args.preset, "device": args.device, "max_batch": args.max_batch, "in_process": True,
                  "engine_set": args.engine_set, "new_tokens": args.new_tokens, "image_size": args.image_size,
                  "requests_per_client": args.requests, "startup_s": round(startup_s, 1), "levels": levels}
        print(table(levels))
        print(json.dumps(report))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            server = start_server(args, port, log)
            try:
                started = time.perf_counter()
                wait_ready(url, server, args.startup_timeout_s, log_path)
                startup_s = time.perf_counter() - started
                # warm-up: a batch of full-length requests (allocator, kernels, any compilation)
                asyncio.run(run_level(url, argparse.Namespace(**{**vars(args), "requests": 1}),
                                      min(4, max(args.clients)), 10**6))
                levels, seed = [], 0
                for clients in args.clients:
                    # the level's own warm-up, untimed: one request a client, so that the CUDA graphs of
                    # its slot and length buckets are captured before it is timed (a server's steady state)
                    asyncio.run(run_level(url, argparse.Namespace(**{**vars(args), "requests": 1}), clients, 10**7))
                    before = batch_stats(url)
                    level = asyncio.run(run_level(url, args, clients, seed))
                    after = batch_stats(url)
                    level["mean_batch"] = round((after[0] - before[0]) / max(1.0, after[1] - before[1]), 2)
                    level["max_running"] = httpx.get(f"{url}/health", timeout=30).json().get("max_batch_seen")
                    levels.append(level)
                    seed += clients * args.requests
                    print(f"{clients} clients: {level['requests_per_s']} requests/s", file=sys.stderr, flush=True)
            finally:
                server.terminate()
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
    report = {"preset": args.preset, "device": args.device, "max_batch": args.max_batch,
              "new_tokens": args.new_tokens, "image_size": args.image_size, "requests_per_client": args.requests,
              "serve_args": args.serve_arg, "server_switch_interval": args.server_switch_interval,
              "engine": _engine_of(args.serve_arg), "server_startup_s": round(startup_s, 1), "levels": levels}
    print(table(levels))
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
