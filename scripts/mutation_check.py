"""Mutation check: each listed feature switched off in turn, in a temporary copy of the repository,
and the tests that claim it run there; lists every mutation the tests do not catch.

    .venv/bin/python scripts/mutation_check.py                 # every mutation (docs/testing.md: its last result)
    .venv/bin/python scripts/mutation_check.py fusion replay   # some, by name
    .venv/bin/python scripts/mutation_check.py --list          # names, files and tests, nothing run
    options: --json PATH (the results as JSON), --no-baseline (skip the unmutated runs), --keep (keep the copy),
             --head (copy the last commit instead of the working tree)

A mutation is (name, file, the exact original text, its replacement, the tests that must catch it).
For each: the tests run on the unmutated copy first (they must pass, else the result says nothing),
then the text is replaced (it must occur exactly once: a stale entry is an error, not a pass), the
tests run again with -x, and the file is restored. Caught means pytest reported failing tests (exit
code 1); any other exit (an import error, no test collected) is listed as a problem. Exit status: 0
when every mutation was caught, 1 otherwise.

Why a copy: other people edit the working tree while this runs, so nothing here writes to it. The
copy holds what git would see (tracked files and untracked ones not ignored, as they are now; with
--head, the last commit), and its own `vlforge` is checked to be the one its tests import (the
venv's editable install points at the working tree). Why hand-written rather than mutmut or cosmic-ray: those mutate operators all over
a file (thousands of runs of the whole suite); this is a short list of chosen "switch the feature
off" edits, each run against the few tests that name the feature.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str  # exact text, found exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest arguments: paths or node ids
    what: str  # the feature switched off, in words


MUTATIONS = [
    Mutation(
        "judge", "vlforge/rl/judge.py",
        # at the top of ModelJudge.__call__ (its signature's last line): every reply unparsed, no model asked
        "                 prompts: list[list[dict]]) -> list[float]:\n",
        "                 prompts: list[list[dict]]) -> list[float]:\n"
        "        self.scored += len(completions)\n        self.unparsed += len(completions)\n"
        "        return [0.0] * len(completions)\n",
        ("tests/test_judge.py",),
        "the judge reward scores every reply as unparsed without asking its model"),
    Mutation(
        "fusion", "vlforge/generate/runner.py",
        "return self.fused.installed() if plan.fusing else nullcontext()",
        "return nullcontext()",
        ("tests/test_fused.py::test_the_engines_prefill_and_decode_steps_run_one_gemm_per_group",),
        "the engine's forwards run one GEMM per projection although it prepared fused ones"),
    Mutation(
        "fusion-fsdp", "vlforge/generate/fused.py",
        "        if fsdp_sharded(core):\n            return 0\n",
        "",
        ("tests/test_fused.py::test_nothing_is_fused_under_fsdp2",),
        "FSDP2's gathered weights are fused (swapped off its all-gather buffers)"),
    Mutation(
        "replay", "vlforge/recipes/grpo.py",
        "replay = cfg.rollout.router_replay is True",
        "replay = False",
        ("tests/test_router_replay.py::test_grpo_update_replays_the_rollouts_experts_where_the_router_would_choose_others",),
        "GRPO's update runs the trainer's own experts under rollout.router_replay=true"),
    Mutation(
        "cispo-clip-low", "vlforge/rl/core.py",
        "weight_NT = torch.clamp(ratio_NT, 1.0 - clip_low, 1.0 + clip_high).detach()",
        "weight_NT = torch.clamp(ratio_NT, max=1.0 + clip_high).detach()",
        ("tests/test_rl_core.py",),
        "CISPO's importance weight is not truncated below (clip_low ignored)"),
    Mutation(
        "gspo-clip-low", "vlforge/rl/core.py",
        "clipped_NT = -adv_NT * torch.clamp(ratio_NT, 1.0 - clip_low, 1.0 + clip_high)",
        "clipped_NT = -adv_NT * (torch.clamp(ratio_NT, max=1.0 + clip_high) if kind == \"gspo\"\n"
        "                            else torch.clamp(ratio_NT, 1.0 - clip_low, 1.0 + clip_high))",
        ("tests/test_rl_core.py",),
        "GSPO's sequence ratio is not clipped below"),
    Mutation(
        "infer-video", "vlforge/recipes/infer.py",
        "request = Request([user_message(prompt, len(images), len(videos))], images, videos=videos,",
        "request = Request([user_message(prompt, len(images), 0)], images, videos=[],",
        ("tests/test_infer.py::test_infer_sends_the_videos_frames_to_the_model",
         "tests/test_video.py::test_infer_answers_a_video_file_from_the_command_line"),
        "`vlforge infer --video` reads the headers and sends no video"),
    Mutation(
        "hold-gradients", "vlforge/recipes/sft.py",
        "            hold_gradients(optimizer)  # master_weights=optimizer: bf16 gradients summed in fp32\n",
        "            pass\n",
        ("tests/test_master_weights.py::test_sft_accumulates_micro_batch_gradients_in_fp32",
         "tests/test_master_weights.py::test_sft_trains_as_fp32_masters_do"),
        "SFT's accumulated bf16 gradients are summed in bf16 under master_weights=optimizer"),
    Mutation(
        "video-times", "vlforge/data/encode.py",
        "vp.temporal_patch_size, video.times)",
        "vp.temporal_patch_size)",
        ("tests/test_video.py::test_a_variable_rate_file_is_sampled_by_time_and_stamped_with_its_own_timestamps",),
        "a variable-rate video's prompt is stamped at index / average rate, not its frames' own times"),
    Mutation(
        "rollout-correction", "vlforge/rl/core.py",
        "        loss_NT = loss_NT * is_weight.detach()\n",
        "        loss_NT = loss_NT\n",
        ("tests/test_rollout_correction.py::test_the_correction_acts_on_the_gradient",
         "tests/test_rollout_correction.py::test_the_weighted_policy_loss_and_its_gradient_equal_a_hand_written_one"),
        "rl.rollout_correction's weights never reach the policy loss"),
    Mutation(
        "fp8-rollout", "vlforge/rollout/precision.py",
        "return decoding_in_fp8(model, fp8_projections(model)) if cfg.precision == \"fp8\" else nullcontext()",
        "return nullcontext()",
        ("tests/test_fp8_rollout.py::test_an_fp8_rollout_runs_the_projections_as_fp8_gemms_and_leaves_the_trainer_untouched",
         "tests/test_fp8_rollout.py::test_a_grpo_step_with_fp8_rollouts_reports_a_small_mismatch_and_trains_exactly_the_trainable_params"),
        "rollout.precision=fp8's rollouts decode on the bf16 weights"),
    Mutation(
        "fp8-refresh", "vlforge/rollout/precision.py",
        "        copies.refresh()\n",
        "        pass\n",
        ("tests/test_fp8_rollout.py::test_each_rollouts_fp8_copies_are_made_from_the_weights_of_that_step",),
        "the FP8 copies are not made again from the trained weights before a step's rollouts"),
    Mutation(
        "fp8-lora-delta", "vlforge/generate/fp8.py",
        "    if wrapper is base or wrapper.disable_adapters or wrapper.merged:\n",
        "    if True:\n",
        ("tests/test_fp8_rollout.py::test_a_lora_layers_fp8_copy_is_the_quantized_merged_weight",),
        "a LoRA layer's FP8 copy leaves its adapters' delta out (the rollout decodes the base model)"),
]


def repo_files(root: Path) -> list[str]:
    """What git sees in the working tree now: tracked files and untracked ones not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (root / f).is_file()})


def make_copy(root: Path, dest: Path, head: bool = False) -> None:
    """The working tree as git sees it, or (`head`) the last commit's files alone."""
    if head:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=root, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    for f in repo_files(root):
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)


def environment(copy: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_the_copy(copy: Path) -> None:
    where = subprocess.run([sys.executable, "-c", "import vlforge; print(vlforge.__file__)"], cwd=copy,
                           env=environment(copy), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy's tests would import vlforge from {where}, not from the copy {copy}")


def run_tests(copy: Path, tests: tuple[str, ...], first_failure: bool) -> tuple[int, float, str, list[str]]:
    """(pytest's exit code, seconds, its last lines, the tests that failed)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-x"] if first_failure else []), *tests]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=copy, env=environment(copy), capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    failed = [line.split()[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return done.returncode, time.monotonic() - start, "\n".join(lines[-6:]), failed


def check_one(copy: Path, m: Mutation, baseline: bool) -> dict:
    path = copy / m.file
    source = path.read_text()
    found = source.count(m.original)
    result = {**asdict(m), "status": None, "baseline_rc": None, "mutated_rc": None, "seconds": 0.0, "tail": "",
              "failed": []}
    if found != 1:
        result["status"] = f"stale: the original text occurs {found} times in {m.file}"
        return result
    if baseline:
        rc, seconds, tail, _ = run_tests(copy, m.tests, first_failure=False)
        result.update(baseline_rc=rc, seconds=seconds)
        if rc != 0:
            result.update(status="baseline fails (the tests fail without the mutation)", tail=tail)
            return result
    path.write_text(source.replace(m.original, m.replacement))
    try:
        rc, seconds, tail, failed = run_tests(copy, m.tests, first_failure=True)
    finally:
        path.write_text(source)
    result.update(mutated_rc=rc, seconds=result["seconds"] + seconds, tail=tail, failed=failed)
    result["status"] = {0: "NOT CAUGHT", 1: "caught"}.get(rc, f"problem: pytest exit code {rc}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--head", action="store_true", help="copy the last commit, not the working tree")
    args = ap.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if unknown := [n for n in args.names if n not in known]:
        ap.error(f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(known)}")
    chosen = [known[n] for n in args.names] if args.names else MUTATIONS
    if args.list:
        for m in chosen:
            print(f"{m.name:16} {m.file}: {m.what}\n{'':16} tests: {' '.join(m.tests)}")
        return 0
    copy = Path(tempfile.mkdtemp(prefix="vlforge-mutation-"))
    results = []
    try:
        make_copy(ROOT, copy, head=args.head)
        check_imports_the_copy(copy)
        for m in chosen:
            print(f"{m.name}: {m.what} ...", flush=True)
            results.append(check_one(copy, m, baseline=not args.no_baseline))
            r = results[-1]
            detail = f" by {', '.join(r['failed'])}" if r["status"] == "caught" else f"\n{r['tail']}"
            print(f"  {r['status']} ({r['seconds']:.0f} s){detail}", flush=True)
    finally:
        if args.keep:
            print(f"copy kept at {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    missed = [r for r in results if r["status"] != "caught"]
    print(f"\n{len(results) - len(missed)} of {len(results)} mutations caught"
          + (": not caught: " + ", ".join(f"{r['name']} ({r['status']})" for r in missed) if missed else ""))
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "results": results}, indent=1) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
