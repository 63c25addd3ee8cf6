"""What the shipped recipes give a user: each run through the real CLI as the README says (no flags
beyond data, step count and `train.grad_accum=1`), beside the plain-transformers peer, in one GPU run;
prints one table of ratios and writes the rows as JSON.

    python bench/recipes.py --out recipes.json                       # on a CUDA machine (~20-30 min)
    python bench/recipes.py --only sft-2b-full,serve-2b --steps 20
    python bench/recipes.py --only sft-2b-full,grpo-2b-full --second-run    # + each recipe's second start
    python bench/recipes.py --only grpo-2b-full --override compile.enabled=true  # a setting against the recipe
    python bench/recipes.py --smoke                                  # the tiny preset on a CPU (wiring only)

Rows:
- sft-2b-full, sft-8b-lora: `vlforge sft configs/qwen3vl-{2b-full,8b-lora}.yaml` on shared/BASELINES.md's
  samples (sft_throughput.synthetic_samples: one 448x448 image, ~64 prompt tokens, a 128-384-token answer,
  written as a JSONL), batch as the recipe says; median tokens/s of the steps after the first 5 (compile and
  the allocator warm there) and the largest `mem/peak_allocated_gb` of its metrics rows; beside
  `bench/train.py --paths peer` (plain transformers (+peft, LoRA r=16 on the attention), fp32 masters, bf16
  autocast, fused AdamW, no checkpointing) on the same preset, in its own process after ours.
- grpo-2b-full, grpo-8b-lora: `vlforge grpo` on the shapes data with a reward of some variance on random
  weights (bench/varied_reward.py; random weights never answer right, so the shipped reward would train
  nothing); the first step (its compile) apart from the median tokens/s of the others.
- serve-2b: `bench/serve_load.py --clients 32` (the server's defaults): completion tokens/s and TTFT p50.

Random weights of the published architectures (the presets): no downloads. One process per row, so each
starts from an empty GPU; the peer rows run right after ours on the same card.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

SFT = {"sft-2b-full": ("qwen3vl-2b-full", "qwen3vl-2b", "full"), "sft-8b-lora": ("qwen3vl-8b-lora", "qwen3vl-8b", "lora")}
GRPO = {"grpo-2b-full": "qwen3vl-2b-grpo", "grpo-8b-lora": "qwen3vl-8b-grpo"}
ROWS = [*SFT, *GRPO, "serve-2b"]


def _run(cmd: list[str], log: Path, timeout: float) -> bool:
    """A row's command, its output in `log`; False (and the log's tail printed) when it fails."""
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0:
        print(f"failed ({code}): {' '.join(cmd)}\n{log.read_text()[-2000:]}", file=sys.stderr)
    return code == 0


def _metrics(run_dir: Path, skip: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "tokens_per_s" in r]
    later = steps[skip:] or steps
    out = {"steps": len(steps), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
           "peak_gb": max((r.get("mem/peak_allocated_gb", r.get("mem/peak_rss_gb", 0.0)) for r in steps), default=None)}
    if mfu := [r["mfu"] for r in later if "mfu" in r]:
        out["mfu"] = statistics.median(mfu)
    if steps and "step_time_s" in steps[0]:
        out["first_step_s"] = steps[0]["step_time_s"]
    return out


def sft_data(tmp: Path, n: int) -> Path:
    from sft_throughput import synthetic_samples

    rows = []
    for s in synthetic_samples(n, str(tmp), 448, random.Random(0)):
        user, assistant = s.messages
        text = next(c["text"] for c in user["content"] if c["type"] == "text")
        rows.append({"image": str(s.images[0]), "text": text, "answer": assistant["content"]})
    path = tmp / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_row(name: str, data: Path, tmp: Path, args) -> dict:
    recipe, preset, method = SFT[name]
    run_dir = tmp / name
    smoke = ["model.preset=tiny", "precision.mode=fp32"] if args.smoke else []
    ours = [sys.executable, "-m", "vlforge", "sft", f"configs/{recipe}.yaml", f"data.train={data}", "data.val=null",
            "train.grad_accum=1", f"train.max_steps={args.steps}", f"train.output_dir={run_dir}", "log.progress=false", "log.every=1",
            "train.overwrite=true", *smoke, *args.override]
    row = {"row": name, "command": " ".join(ours[1:])}
    if not _run(ours, tmp / f"{name}.log", args.timeout):
        return {**row, "error": "ours failed"}
    row["ours"] = _metrics(run_dir, skip=5)
    _second_run(row, ours, run_dir, name, tmp, args)
    peer_json = tmp / f"{name}-peer.json"
    peer = [sys.executable, str(BENCH / "train.py"), "--preset", "tiny" if args.smoke else preset, "--method", method,
            "--paths", "peer", "--steps", str(args.steps), "--json", str(peer_json)]
    if _run(peer, tmp / f"{name}-peer.log", args.timeout):
        p = json.loads(peer_json.read_text())["results"][0]
        row["peer"] = {"tokens_per_s": p.get("tokens_per_s"), "peak_gb": p.get("peak_gb"), "mfu": p.get("mfu")}
    return row


def grpo_row(name: str, tmp: Path, args) -> dict:
    shapes = tmp / "shapes"
    if not (shapes / "train.jsonl").exists():
        _run([sys.executable, "-m", "vlforge", "data", "synth", "shapes", "--n", "72", "--out", str(shapes), "--size",
              "448", "--val-fraction", "0.12"], tmp / "synth.log", 600)
    run_dir = tmp / name
    smoke = ["model.preset=tiny", "precision.mode=fp32", "rollout.max_new_tokens=16"] if args.smoke else []
    ours = [sys.executable, "-m", "vlforge", "grpo", f"configs/{GRPO[name]}.yaml", f"data.train={shapes / 'train.jsonl'}",
            "data.val=null", f"train.max_steps={max(3, args.steps // 4)}", f"train.output_dir={run_dir}", "log.every=1",
            "log.progress=false", "train.overwrite=true", f"rl.rewards=[{{name: {BENCH / 'varied_reward.py'}:length_mod3}}]",
            *smoke, *args.override]
    row = {"row": name, "command": " ".join(ours[1:])}
    if not _run(ours, tmp / f"{name}.log", args.timeout):
        return {**row, "error": "ours failed"}
    row["ours"] = _metrics(run_dir, skip=1)
    _second_run(row, ours, run_dir, name, tmp, args)
    return row


def _second_run(row: dict, cmd: list[str], run_dir: Path, name: str, tmp: Path, args) -> None:
    """--second-run: the same command again into another directory, so that torch's compile caches
    (under VLFORGE_CACHE, train/runtime.use_compile_caches) are warm: its first step's seconds."""
    if not args.second_run:
        return
    again = tmp / f"{name}-again"
    cmd = [a.replace(f"train.output_dir={run_dir}", f"train.output_dir={again}") for a in cmd]
    if _run(cmd, tmp / f"{name}-again.log", args.timeout):
        row["ours"]["second_first_step_s"] = _metrics(again, skip=0).get("first_step_s")


def serve_row(tmp: Path, args) -> dict:
    out = tmp / "serve.json"
    cmd = [sys.executable, str(BENCH / "serve_load.py"), "--preset", "tiny" if args.smoke else "qwen3vl-2b",
           "--clients", "32", "--requests", "3", "--out", str(out)]
    if args.smoke:
        cmd += ["--clients", "2", "--requests", "1", "--new-tokens", "4", "8", "--image-size", "64"]
    row = {"row": "serve-2b", "command": " ".join(cmd[1:])}
    if not _run(cmd, tmp / "serve.log", args.timeout):
        return {**row, "error": "serve_load failed"}
    level = json.loads(out.read_text())["levels"][-1]
    return {**row, "ours": {k: level[k] for k in ("clients", "completion_tokens_per_s", "requests_per_s", "ttft_p50_s",
                                                  "ttft_p99_s", "mean_batch")}}


def table(rows: list[dict]) -> str:
    lines = ["| row | ours tokens/s | peer tokens/s | ratio | ours peak GB | peer peak GB | MFU "
             "| first step s (second run) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | | | | |")
            continue
        o, p = r["ours"], r.get("peer", {})
        tps = o.get("tokens_per_s", o.get("completion_tokens_per_s"))
        ratio = f"{tps / p['tokens_per_s']:.2f}x" if p.get("tokens_per_s") else "-"
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        extra = f" (TTFT p50 {o['ttft_p50_s']} s at {o['clients']} clients)" if "ttft_p50_s" in o else ""
        lines.append(f"| {r['row']} | {tps:,.0f}{extra} | {fmt(p.get('tokens_per_s'), ',.0f')} | {ratio} | "
                     f"{fmt(o.get('peak_gb'), '.1f')} | {fmt(p.get('peak_gb'), '.1f')} | "
                     f"{fmt(o.get('mfu'), '.1%')} | {fmt(o.get('first_step_s'), '.1f')}"
                     + (f" ({o['second_first_step_s']:.1f})" if o.get("second_first_step_s") is not None else "")
                     + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(ROWS), help=f"comma-separated rows of {ROWS}")
    ap.add_argument("--steps", type=int, default=40, help="SFT steps (GRPO runs a quarter of them, at least 3)")
    ap.add_argument("--samples", type=int, default=64, help="distinct SFT samples, cycled by the epochs")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--smoke", action="store_true", help="the tiny preset in fp32, few tokens: wiring on a CPU")
    ap.add_argument("--second-run", action="store_true",
                    help="run each SFT/GRPO recipe twice: the second's first step with warm compile caches")
    ap.add_argument("--override", nargs="*", default=[],
                    help="config overrides for every SFT/GRPO row (an A/B of a setting against the shipped recipe)")
    ap.add_argument("--keep", help="keep the runs, logs and data in this folder (default: a temporary one)")
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args()
    wanted = args.only.split(",")
    if unknown := set(wanted) - set(ROWS):
        ap.error(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.keep or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        data = sft_data(tmp, args.samples) if set(wanted) & set(SFT) else None
        rows = []
        for name in wanted:
            rows.append(sft_row(name, data, tmp, args) if name in SFT else grpo_row(name, tmp, args) if name in GRPO
                        else serve_row(tmp, args))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
