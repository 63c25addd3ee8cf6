"""The bookkeeping every training recipe wraps around its step loop, written once.

    with begin_run(cfg) as (world, resume_from):        # before any model loads; holds output_dir
        t = setup_model(cfg, ..., world=world); data = ...
        run = Run.start(cfg, t, total_steps, val_data, resume_from, spikes=True)
        while run.step < total_steps:
            ...one recipe step: run.optimizer, run.scaler, run.health...
            run.finish_step(row, always_log=...)        # schedule, metrics, eval, checkpoint
        run.close()

A recipe keeps its own step (what a step is, its metrics); this module owns the output
directory, the optimizer / schedule / loss scaler / gradient-health set, exact resume, the
metrics log, periodic evaluation and checkpoints, so SFT and GRPO do these identically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vlforge.config import ConfigError, RunConfig, dump_config, resolve_paths
from vlforge.data.dataset import ChatDataset
from vlforge.train.checkpoint import (checkpoint_bytes, checkpoints_held, list_checkpoints, load_checkpoint,
                                       load_sharded_checkpoint, save_checkpoint, save_sharded_checkpoint, space_problem)
from vlforge.train.distributed import World, init_world
from vlforge.train.sharding import gathered
from vlforge.train.evaluate import EvalRecorder
from vlforge.train.health import GradHealth
from vlforge.train.identity import KEY as IDENTITY_KEY, check_resume_identity, model_identity
from vlforge.train.metrics import MetricsLog, NullMetrics
from vlforge.train.optim import build_optimizer, build_scheduler
from vlforge.train.rng import fresh_rng
from vlforge.train.samples import SampleLog
from vlforge.train.trackers import TrackedMetrics, Trackers
from vlforge.train.runtime import prepare_output_dir, release_output_dir, seed_everything
from vlforge.train.precision import PrecisionPolicy
from vlforge.train.trainable import Trainable
from vlforge.model.tiers import param_groups


def write_config(out: Path, cfg: RunConfig, recompute=None, policy: PrecisionPolicy | None = None,
                 masters_note: str | None = None) -> None:
    """The run's config.yaml: what acts in it, paths absolute; activation checkpointing as settled
    for this run (train/recompute.py: enabled=auto written as what it chose, and why, on top), and
    so precision.master_weights (the `policy`'s, settled by setup_model; `masters_note`: why)."""
    cfg = resolve_paths(cfg)  # a copy
    header = ""
    if recompute is not None:
        cfg.activation_checkpointing.enabled = bool(recompute.every)
        cfg.activation_checkpointing.every = recompute.every or 1
        header = f"# {recompute.note()}\n"
    if policy is not None:
        cfg.precision.master_weights = policy.cfg.master_weights
    header += f"# {masters_note}\n" if masters_note else ""
    (out / "config.yaml").write_text(header + dump_config(cfg))


def due(every: int, step: int, total_steps: int) -> bool:
    """Every `every` steps (0: never) and always at the last step: when to log, evaluate, save."""
    return bool(every and step % every == 0) or step == total_steps


@contextlib.contextmanager
def begin_run(cfg: RunConfig) -> Iterator[tuple[World, Path | None]]:
    """What happens before any model loads: join the run's processes (torchrun), claim
    train.output_dir (rank 0 locks it for the run; another run's results are refused), seed.
    Yields (world, checkpoint to resume from or None); the lock is released when the block ends,
    however it ends."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is the progress display; no per-save shard bars
    world = init_world(cfg.distributed, cfg.train.device)
    ended_normally = False
    try:
        claim: tuple[Path | None, str | None] = (None, None)
        if world.main:  # one process claims the directory; the others learn the outcome from it
            try:
                claim = (prepare_output_dir(cfg.train.output_dir, cfg.train.resume, cfg.train.overwrite), None)
            except ConfigError as e:
                claim = (None, str(e))
        resume_from, error = world.broadcast(claim)
        if error:
            raise ConfigError(error)
        try:
            seed_everything(cfg.train.seed)  # the same on every rank: presets initialise identically
            yield world, resume_from
        finally:
            if world.main:
                release_output_dir(cfg.train.output_dir)
        ended_normally = True
    finally:
        world.close(together=ended_normally)


@dataclass
class Run:
    cfg: RunConfig
    t: Trainable
    out: Path
    total_steps: int
    optimizer: object
    scheduler: object
    scaler: object
    health: GradHealth
    metrics: MetricsLog
    recorder: EvalRecorder | None
    state: dict  # epoch, position (and recipe counters): saved in every checkpoint
    step: int
    last_eval: dict | None = None
    samples: SampleLog | None = None  # samples/: what the model did (GRPO groups, eval answers)

    @classmethod
    def start(cls, cfg: RunConfig, t: Trainable, total_steps: int, val_data: ChatDataset | None,
              resume_from: Path | None, *, spikes: bool, state: dict | None = None, shared_rng: bool = False,
              answer: Callable | None = None) -> "Run":
        """Build the optimizer set, resume, write config.yaml (only now, when the run can start).
        `shared_rng`: the recipe keeps one RNG stream in lockstep on every rank (GRPO), so a resume
        gives every rank rank 0's; otherwise each rank its own (train.checkpoint.restore_rng).
        `answer`: how the evaluation answers its prompts (train.evaluate.generate_answers' signature;
        GRPO with tools: as conversations with them)."""
        out, world = Path(cfg.train.output_dir), t.world
        optimizer = build_optimizer(param_groups(t.model, t.plan, cfg.optim.weight_decay), cfg.optim, t.device.type,
                                    masters=t.policy.take_masters())
        scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
        scaler = t.policy.grad_scaler()
        health = GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode, spikes=spikes)
        state = {"epoch": 0, "position": 0, **(state or {})}
        # what this run trains from, saved in every checkpoint's trainer_state.json (train/identity.py)
        identity = model_identity(cfg.model, cfg.tiers.method, t.processor.tokenizer)
        if resume_from is not None:
            # before any weight is read: a checkpoint of another model is refused, naming both
            note = check_resume_identity(resume_from, identity)
            rng = {"seed": cfg.train.seed, "shared_rng": shared_rng}
            if world.sharded:
                state = load_sharded_checkpoint(resume_from, t.model, optimizer, scheduler, scaler, world, **rng)
            else:  # one process, or DDP: every rank loads the same one-process checkpoint (its own RNG)
                state = load_checkpoint(resume_from, t.model, optimizer, scheduler, scaler, rank=world.rank, **rng)
            if world.main:
                print(f"resumed from {resume_from} at step {state['step']}" + (f"\nnote: {note}" if note else ""))
                saved = state.get("world_size")  # None: a checkpoint from before it was recorded
                if saved is not None and saved != world.size and not shared_rng:
                    print(f"note: the checkpoint was saved by {saved} process(es), this run has {world.size}: "
                          "weights, optimizer and data order continue exactly, the RNG streams (dropout) do not "
                          "(ranks the saving run lacked start fresh ones from train.seed, step and rank); "
                          f"exact resume needs {saved} process(es)")
        elif world.size > 1 and world.rank > 0 and not shared_rng:
            # a fresh start: every rank was seeded alike so that presets initialise identically; from
            # here each rank > 0 draws its own stream (its dropout masks), rank 0 goes on with the
            # one-process run's
            fresh_rng(cfg.train.seed, 0, world.rank)
        state[IDENTITY_KEY] = identity
        state["master_weights"] = t.policy.cfg.master_weights  # a resume keeps this form (settle_master_weights)
        state["total_steps"] = total_steps  # in every checkpoint: `vlforge view` tells a finished run from a stopped one
        # after the resume: a checkpoint refused as another config's leaves the config.yaml it was saved with;
        # paths stored absolute, so the run's checkpoints export, infer and serve anywhere
        if world.main:
            write_config(out, cfg, t.recompute, t.policy, t.masters_note)
            if t.recompute is not None:  # an out-of-memory step's move is recorded there too
                t.recompute.record = functools.partial(write_config, out, cfg, t.recompute, t.policy, t.masters_note)
        step = state.get("step", 0)
        if world.main:  # before hours of training, not at the first save: will the checkpoints fit?
            saves_left = sum(due(cfg.train.save_every, s, total_steps) for s in range(step + 1, total_steps + 1))
            held = checkpoints_held(saves_left, len(list_checkpoints(out)), cfg.train.keep_last)
            per = checkpoint_bytes(t.model, cfg.optim.name, t.policy.masters_in_optimizer)
            if problem := space_problem(shutil.disk_usage(out).free, per, held, out):
                print(f"warning: {problem}")
        # every rank evaluates (a sharded forward needs them all; DDP's ranks would wait for rank 0 anyway); rank 0 writes
        metrics = MetricsLog(out, cfg.log.tensorboard, resume_step=step if resume_from else 0) if world.main \
            else NullMetrics()
        settled = dataclasses.replace(cfg, precision=t.policy.cfg)  # master_weights as settled (setup_model)
        trackers = Trackers(cfg.log, out, dataclasses.asdict(resolve_paths(settled))) \
            if world.main and (cfg.log.wandb or cfg.log.mlflow) else None
        metrics = TrackedMetrics(metrics, trackers) if trackers else metrics  # the same rows to wandb / MLflow
        lc = cfg.log  # samples/ (train/samples.py): rank 0 writes
        samples = SampleLog(out, every=lc.samples_every, per_step=lc.samples_per_step, eval_rows=lc.samples_eval,
                            max_mb=lc.samples_max_mb, resume_step=step if resume_from else 0, write=world.main,
                            trackers=trackers)
        recorder = EvalRecorder(out, val_data, cfg.eval, metrics, step, write=world.main, loss=cfg.loss,
                                answer=answer, samples=samples) if val_data is not None else None
        return cls(cfg, t, out, total_steps, optimizer, scheduler, scaler, health, metrics, recorder, state, step,
                   samples=samples)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def evaluate(self) -> dict | None:
        """Evaluate now (at self.step) when there is validation data."""
        if self.recorder is None:
            return None
        # CUDA graphs (compile.cuda_graphs) are recorded per shape: the evaluation's padded batches and
        # generation would record graphs of their own for every length, so it runs eager
        with gathered(self.t.root), (torch.compiler.set_stance("force_eager") if self.t.cuda_graphs
                                     else contextlib.nullcontext()):  # sharded: every rank evaluates, gathered
            self.last_eval = self.recorder(self.t.model, self.step, self.t.policy, self.t.device)
        return self.last_eval

    def finish_step(self, row: dict, always_log: bool = False) -> None:
        """After a recipe's optimizer step(s): advance the schedule and the step, log the row (every
        log.every steps, the last step, and whenever `always_log`: bad steps are never hidden),
        evaluate and checkpoint when due."""
        # the schedule counts batches, not updates: it advances after a step that made none (an fp16
        # overflow the loss scaler skipped, a GRPO step whose groups all tied), by design. torch reads
        # a first scheduler step before any optimizer.step() as a misordered loop; here it is not
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        self.step += 1
        if due(self.cfg.log.every, self.step, self.total_steps) or always_log:
            # when the step ended: `vlforge view` draws curves over time too (varies run to run, as tokens_per_s)
            self.metrics.log(self.step, {**row, "time_unix": round(time.time(), 2)})
        if due(self.cfg.eval.every, self.step, self.total_steps):
            self.evaluate()
        if due(self.cfg.train.save_every, self.step, self.total_steps):
            self.save()

    def save(self) -> None:
        """Write checkpoint-STEP now (every rank calls it: under torchrun the save is collective);
        finish_step when due, train/stop.py when a signal stops the run."""
        args = (self.out, self.step, self.t.model, self.t.processor, self.optimizer, self.scheduler, self.scaler,
                self.state, self.cfg.train.keep_last)
        if self.t.world.sharded:
            save_sharded_checkpoint(*args, self.t.world)
        else:  # one process, or DDP (identical replicas: rank 0 writes, each rank adds its RNG)
            save_checkpoint(*args, world=self.t.world if self.t.world.replicated else None)

    def close(self) -> None:
        self.metrics.close()
