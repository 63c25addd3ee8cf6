"""SIGINT / SIGTERM (train/stop.py): a training run finishes the step in progress, writes a
checkpoint of it and exits with a message and 130 / 143; a second Ctrl-C stops at once, keeping
the finished checkpoints; under torchrun every rank stops after the same step; chat, serve and
the other commands end on a signal in one line. The runs are the real CLI in a subprocess on the
tiny preset, signalled once training has started (a row in metrics.jsonl) the way a scheduler or
a terminal signals a job: every process of its group, its DataLoader workers included."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vlforge.train.checkpoint import TMP_PREFIX
from vlforge.train.stop import Interrupted
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

TIMEOUT_S = 240
RECIPE = str(Path(__file__).parent / "resume.yaml")  # the tiny LoRA recipe of the SIGKILL resume test


@pytest.fixture(autouse=True)
def default_signal_actions():
    """Each test starts from Python's own SIGINT and SIGTERM actions, whatever the process running the
    suite was given (a job started with SIGINT ignored passes that on to every process it starts, and
    vlforge keeps an ignored signal ignored) or an earlier test left: the runs these tests start inherit
    them."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in previous.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class Launched:
    """A CLI run in a session of its own (its process group: the run and its helper processes),
    its output in files that can be read while it runs."""

    def __init__(self, args: list[str], tmp_path: Path, name: str, torchrun: bool = False, stdin=subprocess.DEVNULL):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] \
            if torchrun else [sys.executable]
        self.out, self.err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([*prefix, "-m", "vlforge", *args], cwd=tmp_path, env=env, stdout=out,
                                         stderr=err, stdin=stdin, start_new_session=True)

    def wait_for(self, ready, what: str) -> None:
        deadline = time.time() + TIMEOUT_S
        while not ready():
            if self.proc.poll() is not None or time.time() > deadline:
                self.kill()
                pytest.fail(f"{what} never happened (exit {self.proc.returncode}): {self.stderr[-3000:]}")
            time.sleep(0.02)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not end after the signal: {self.stderr[-3000:]}")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training(run_dir: Path):
    return lambda: (run_dir / "metrics.jsonl").exists() and bool((run_dir / "metrics.jsonl").read_text().strip())


def stopped_step(stderr: str, signal_name: str, total: int) -> int:
    found = re.findall(rf"stopped by {signal_name} after step (\d+) of {total}: (\S+) is saved; rerun the same "
                       r"command with train\.resume=auto", stderr)
    assert len(found) == 1, stderr[-3000:]  # said once (one process speaks for the run)
    step, path = int(found[0][0]), Path(found[0][1])
    assert path.name == f"checkpoint-{step}" and 1 <= step < total, stderr[-3000:]
    return step


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name)


def test_sigterm_finishes_the_sft_step_saves_it_and_resume_continues(shapes_dir, tmp_path):
    """SIGTERM to the run's whole process group (the trainer and its DataLoader worker, as SLURM
    signals a job's processes): exit 143, checkpoint-N of the step it stopped after (save_every
    would write none before the end), the metrics up to N, no traceback; train.resume=auto then
    continues from N to the end, each step logged once."""
    out, total = tmp_path / "run", 30
    args = ["sft", RECIPE, f"data.train={shapes_dir / 'train.jsonl'}", f"train.output_dir={out}",
            f"train.max_steps={total}", "train.save_every=1000", "log.every=1", "data.num_workers=1"]
    run = Launched(args, tmp_path, "first")
    run.wait_for(training(out), "a training step")
    run.signal_group(signal.SIGTERM)
    assert run.finish() == 143, run.stderr[-3000:]
    n = stopped_step(run.stderr, "SIGTERM", total)
    assert "Traceback" not in run.stderr and "SIGTERM received" in run.stderr
    assert checkpoints(out) == [f"checkpoint-{n}"]
    assert json.loads((out / f"checkpoint-{n}" / "trainer_state.json").read_text())["step"] == n
    assert steps(out)[-1] == n

    resumed = Launched(args + ["train.resume=auto"], tmp_path, "resumed")
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{n}'} at step {n}" in resumed.stdout
    assert steps(out) == list(range(1, total + 1))  # no step missing or logged twice


def test_a_second_ctrl_c_stops_at_once_naming_the_finished_checkpoint(shapes_dir, tmp_path):
    """Ctrl-C once (the run says it will finish the step), then again: exit 130 at once, the
    step in progress not saved, the message naming checkpoint-1 (finished before), no traceback.
    A step here is one pass over the data (32 micro-batches), seconds on a CPU: both signals land
    in step 2."""
    out = tmp_path / "run"
    args = ["sft", RECIPE, f"data.train={shapes_dir / 'train.jsonl'}", f"train.output_dir={out}",
            "train.max_steps=5", "train.save_every=1", "train.batch_size=2", "train.grad_accum=32"]
    run = Launched(args, tmp_path, "run")
    run.wait_for(lambda: (out / "checkpoint-1").is_dir(), "checkpoint-1")  # renamed into place: finished
    run.signal_group(signal.SIGINT)
    run.wait_for(lambda: "SIGINT received" in run.stderr, "the notice of the first Ctrl-C")
    run.signal_group(signal.SIGINT)
    assert run.finish() == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert (f"stopped at once by a second SIGINT after step 1 of 5: the steps since the last checkpoint are not "
            f"saved; the last finished checkpoint, {out / 'checkpoint-1'}, is intact: rerun the same command with "
            "train.resume=auto") in run.stderr, run.stderr[-3000:]
    assert checkpoints(out) == ["checkpoint-1"]


def test_signals_during_a_save_keep_the_finished_checkpoints(shapes_dir, tmp_path, monkeypatch, capfd):
    """In process, the signals sent from inside a checkpoint's save (its optimizer file), so they
    land there every time. SIGTERM while checkpoint-2 is written: the save completes and the run
    stops after step 2, saying so. Resumed, two Ctrl-Cs while checkpoint-4 is written: it stops at
    once, its partial copy is left unnamed, and the message says checkpoint-3 is intact; resumed
    again, the run goes on from checkpoint-3 and its next save clears the partial copy."""
    real_save = torch.save
    plan = {}  # step -> the signals to send from inside that step's save

    def save(obj, f, *args, **kwargs):
        where = Path(f)
        step = re.fullmatch(rf"{re.escape(TMP_PREFIX)}(\d+)-\d+", where.parent.name)
        if where.name == "optimizer.pt" and step and int(step[1]) in plan:
            for sig in plan.pop(int(step[1])):
                os.kill(os.getpid(), sig)  # its handler runs before os.kill returns (CPython, own pid)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    handler = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cfg = lambda *extra: tiny_sft_config(shapes_dir, tmp_path, "train.max_steps=6", "train.save_every=1",
                                         "train.keep_last=5", "data.val=null", "eval.every=0", *extra)
    plan[2] = [signal.SIGTERM]
    with pytest.raises(Interrupted) as stopped:
        run_sft(cfg())
    assert stopped.value.exit_code == 143 and stopped.value.said
    assert f"stopped by SIGTERM after step 2 of 6: {tmp_path / 'checkpoint-2'} is saved" in stopped.value.message
    err = capfd.readouterr().err
    assert "SIGTERM received while checkpoint-2 is being written: the save completes, then the run stops " \
           "(exit code 143)" in err
    assert checkpoints(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["step"] == 2

    plan[4] = [signal.SIGINT, signal.SIGINT]
    with pytest.raises(Interrupted) as at_once:
        run_sft(cfg("train.resume=auto"))
    assert at_once.value.exit_code == 130 and not at_once.value.said
    partial = f"{TMP_PREFIX}4-{os.getpid()}"
    assert at_once.value.message == (
        f"stopped at once by a second SIGINT after step 4 of 6: the steps since the last checkpoint are not saved; "
        f"checkpoint-4 was being written and is not finished: its partial copy {partial} is never resumed from "
        f"(the run's next save removes it); the last finished checkpoint, {tmp_path / 'checkpoint-3'}, is intact: "
        "rerun the same command with train.resume=auto to continue from it")
    assert checkpoints(tmp_path) == [partial, "checkpoint-1", "checkpoint-2", "checkpoint-3"]

    capfd.readouterr()
    assert run_sft(cfg("train.resume=auto"))["final_step"] == 6
    assert f"resumed from {tmp_path / 'checkpoint-3'} at step 3" in capfd.readouterr().out
    assert checkpoints(tmp_path) == [f"checkpoint-{s}" for s in range(2, 7)]  # keep_last=5; no partial copy
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handler  # the run's are gone


def test_sigterm_finishes_the_grpo_step_saves_it_and_resume_continues(shapes_dir, tmp_path):
    out, total = tmp_path / "run", 8
    demo = Path(__file__).parent.parent / "vlforge" / "configs" / "demo-grpo.yaml"
    args = ["grpo", str(demo), f"data.train={shapes_dir / 'train.jsonl'}", "data.val=null", "eval.at_start=false",
            f"train.output_dir={out}", f"train.max_steps={total}", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rl.mini_batch_size=8", "log.progress=false"]
    run = Launched(args, tmp_path, "first")
    run.wait_for(training(out), "a GRPO step")
    run.signal_group(signal.SIGTERM)
    assert run.finish() == 143, run.stderr[-3000:]
    n = stopped_step(run.stderr, "SIGTERM", total)
    assert "Traceback" not in run.stderr
    assert checkpoints(out) == [f"checkpoint-{n}"] and steps(out)[-1] == n

    resumed = Launched(args + ["train.resume=auto"], tmp_path, "resumed")
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{n}'} at step {n}" in resumed.stdout
    assert steps(out) == list(range(1, total + 1))


def rank_pids(run: Launched) -> dict[int, int]:
    """torchrun's ranks: rank -> pid (its children, each with RANK in its environment)."""
    ranks = {}
    for pid in subprocess.run(["pgrep", "-P", str(run.proc.pid)], capture_output=True, text=True).stdout.split():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[int(dict(v.split(b"=", 1) for v in environ if b"=" in v)[b"RANK"])] = int(pid)
    assert sorted(ranks) == [0, 1], ranks
    return ranks


def two_rank_args(shapes_dir: Path, tmp_path: Path, out: Path, total: int) -> list[str]:
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {{train: {shapes_dir / 'train.jsonl'}}}\n")
    return ["sft", str(config), "model.preset=tiny", "precision.mode=fp32", "train.device=cpu", "log.progress=false",
            "data.val=null", "tiers.method=full", "train.batch_size=2", f"train.max_steps={total}",
            "train.save_every=1000", f"train.output_dir={out}"]


def test_ranks_stop_after_the_same_step_when_one_is_signalled(shapes_dir, tmp_path):
    """torchrun, 2 ranks (FSDP2 on gloo): SIGTERM to rank 1 alone. Rank 0 learns it from the
    votes the step's all-reduce carries, so both stop after the same step: checkpoint-N is the
    collective save both took part in, rank 0 says it once, no vlforge traceback (torchrun then
    reports its ranks' exit codes itself). A rank deciding alone would leave the other waiting in
    the next step's collectives."""
    out, total = tmp_path / "run", 200
    run = Launched(two_rank_args(shapes_dir, tmp_path, out, total), tmp_path, "run", torchrun=True)
    run.wait_for(training(out), "a training step")
    os.kill(rank_pids(run)[1], signal.SIGTERM)
    run.finish()
    n = stopped_step(run.stderr, "SIGTERM", total)
    assert "/vlforge/" not in run.stderr, run.stderr[-3000:]  # no traceback through our code on either rank
    assert checkpoints(out) == [f"checkpoint-{n}"] and steps(out)[-1] == n
    assert (out / f"checkpoint-{n}" / "dcp").is_dir() and (out / f"checkpoint-{n}" / "rng-1.pt").is_file()


@pytest.mark.slow  # two 2-rank torchrun launches
def test_sigterm_to_torchrun_stops_every_rank_and_resume_continues(shapes_dir, tmp_path):
    """SIGTERM to torchrun (what Kubernetes sends a pod's first process), which forwards it to its
    ranks: both stop after one step, checkpoint-N is saved, said once; train.resume=auto on 2 ranks
    then continues to the end, each step logged once."""
    out, total = tmp_path / "run", 12
    args = two_rank_args(shapes_dir, tmp_path, out, total)
    run = Launched(args, tmp_path, "first", torchrun=True)
    run.wait_for(training(out), "a training step")
    run.proc.send_signal(signal.SIGTERM)
    run.finish()
    n = stopped_step(run.stderr, "SIGTERM", total)
    assert "/vlforge/" not in run.stderr, run.stderr[-3000:]
    assert checkpoints(out) == [f"checkpoint-{n}"] and steps(out)[-1] == n
    resumed = Launched(args + ["train.resume=auto"], tmp_path, "resumed", torchrun=True)
    assert resumed.finish() == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / f'checkpoint-{n}'} at step {n}" in resumed.stdout
    assert steps(out) == list(range(1, total + 1))


@pytest.mark.slow  # a 2-rank torchrun launch of GRPO
def test_grpo_ranks_stop_after_the_same_step_when_one_is_signalled(shapes_dir, tmp_path):
    """GRPO's ranks sum their votes in an all-reduce at each step's end: SIGTERM to rank 1 alone
    stops both after the same step, with the collective checkpoint of it."""
    out, total = tmp_path / "run", 200
    demo = Path(__file__).parent.parent / "vlforge" / "configs" / "demo-grpo.yaml"
    args = ["grpo", str(demo), f"data.train={shapes_dir / 'train.jsonl'}", "data.val=null", "eval.at_start=false",
            f"train.output_dir={out}", f"train.max_steps={total}", "train.save_every=1000",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rl.mini_batch_size=8", "log.progress=false"]
    run = Launched(args, tmp_path, "run", torchrun=True)
    run.wait_for(training(out), "a GRPO step")
    os.kill(rank_pids(run)[1], signal.SIGTERM)
    run.finish()
    n = stopped_step(run.stderr, "SIGTERM", total)
    assert "/vlforge/" not in run.stderr, run.stderr[-3000:]
    assert checkpoints(out) == [f"checkpoint-{n}"] and steps(out)[-1] == n
    assert (out / f"checkpoint-{n}" / "dcp").is_dir()


def test_chat_ctrl_c_stops_the_reply_and_a_second_one_the_chat():
    """In process: Ctrl-C while a reply streams ends that reply at its next token, the conversation
    goes on (the next message is answered); Ctrl-C twice during a reply raises KeyboardInterrupt."""
    import dataclasses

    from vlforge.recipes.infer import chat
    from vlforge.infer.model import InferenceModel

    engine = InferenceModel.load("tiny", device="cpu", dtype=torch.float32)
    handler = signal.getsignal(signal.SIGINT)
    said, replies, presses = [], [], []
    original = engine.generate

    def generate(requests, on_text=None):  # every reply runs to max_new_tokens unless stopped
        out = original([dataclasses.replace(r, min_new_tokens=r.max_new_tokens) for r in requests], on_text)
        replies.extend(out)
        return out

    def stream(text: str) -> None:  # a key press as the reply's first text shows
        for sig in presses.pop(0) if presses else ():
            os.kill(os.getpid(), sig)  # its handler runs before os.kill returns (CPython, own pid)

    engine.generate = generate
    script, presses[:] = ["hello", "and again", "/quit"], [[signal.SIGINT]]
    chat(engine, read=lambda prompt: script.pop(0), write=said.append, stream=stream, max_new_tokens=40)
    assert [r.finish_reason for r in replies] == ["cancelled", "length"] and script == []
    assert replies[0].completion_tokens < 40 == replies[1].completion_tokens
    assert "(reply stopped by Ctrl-C; what it said stays in the conversation)" in said
    assert signal.getsignal(signal.SIGINT) is handler

    script, presses[:] = ["hello", "/quit"], [[signal.SIGINT, signal.SIGINT]]
    with pytest.raises(KeyboardInterrupt):
        chat(engine, read=lambda prompt: script.pop(0), write=said.append, stream=stream, max_new_tokens=40)
    assert script == ["/quit"] and signal.getsignal(signal.SIGINT) is handler


def test_chat_at_its_prompt_ends_on_ctrl_c_in_one_line(tmp_path):
    """`vlforge chat` waiting for a line: Ctrl-C ends it with one line and 130, no traceback."""
    chat = Launched(["chat", "tiny", "--device", "cpu"], tmp_path, "chat", stdin=subprocess.PIPE)  # no line comes
    chat.wait_for(lambda: "vlforge chat:" in chat.stdout, "the chat's prompt")
    chat.signal_group(signal.SIGINT)
    assert chat.finish() == 130
    assert chat.stderr.strip().splitlines()[-1] == "vlforge chat: interrupted (SIGINT)" and "Traceback" not in chat.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_serve_ends_on_a_signal_in_one_line(tmp_path, sig, code):
    """`vlforge serve` listening: Ctrl-C / SIGTERM drain it and end it with one line, 130 / 143, no
    traceback (uvicorn raises the signal again once shut down)."""
    pytest.importorskip("fastapi", reason="the serve extra: pip install 'vlforge[serve]'")
    server = Launched(["serve", "tiny", "--device", "cpu", "--port", "0"], tmp_path, "serve")
    server.wait_for(lambda: "Uvicorn running" in server.stderr, "the server")
    server.signal_group(sig)
    assert server.finish() == code, server.stderr[-3000:]
    assert server.stderr.strip().splitlines()[-1].startswith(f"vlforge serve: stopped by {sig.name}")
    assert "Traceback" not in server.stderr
    assert "Application shutdown complete" in server.stderr  # uvicorn's shutdown ran: a drain, not a kill
