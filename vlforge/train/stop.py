"""Stopping on a signal: SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send before they
preempt or cancel a job) end a training run between two steps, with a checkpoint.

    with StopSignals() as stop, begin_run(cfg) as (world, resume_from):
        ...load the model and data (a signal now stops at once: nothing to save yet)
        run = Run.start(...)
        stop.watch(run)                             # from here a signal lets the step in progress finish
        while run.step < run.total_steps:
            ...the step (SFT: its first all-reduce carries stop.vote(), then stop.tally(...))
            run.finish_step(row)
            if stop.agreed():                       # every rank: the same answer after the same step
                break
        stop.checkpoint()                           # stopped early: checkpoint-STEP, unless finish_step wrote it
        ...close the run
    # leaving: begin_run lets the ranks leave together, then Interrupted (the message, exit 128 + signal)

The first signal only marks the stop: the step in progress finishes (its update, metrics, a due
evaluation or save: a save being written completes), a checkpoint of that step is written, and the
process exits with 130 (SIGINT) or 143 (SIGTERM), naming it. Not 0: the run is not finished, and
schedulers and job controllers rerun (requeue, restart) a task that ended on a signal's code;
`train.resume=auto` then continues from the checkpoint. A second Ctrl-C raises at once (Interrupted):
checkpoints are only ever renamed into place when complete (train/checkpoint.py), so the finished
ones stay intact and a torn save is never resumed from. A repeated SIGTERM is ignored: a scheduler
signals every process of a job and torchrun forwards its own, so one rank may get two.

Outside a training run the CLI makes SIGTERM an exception too (`sigterm_interrupts`), as Python
makes SIGINT one: every command then ends on either with one line and 128 + the signal, no traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop asked by a signal, as an exception no `except Exception` swallows (Python makes SIGINT a
    KeyboardInterrupt; this carries SIGTERM the same way). `message`: what was saved and how to go
    on (None: the CLI says the command was stopped); `said`: the run printed it already (rank 0, as
    its checkpoint was written: before any rank could leave, so a launcher stopping the ranks that
    remain once one has ended cannot cut it off)."""

    def __init__(self, signum: int = signal.SIGINT, message: str | None = None, said: bool = False):
        super().__init__(message or signal.Signals(signum).name)
        self.signum, self.message, self.said = int(signum), message, said

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal.signal works only there


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def _catch(signals, handler) -> dict:
    """`handler` for each of `signals` not ignored; returns the handlers replaced, to restore. A
    signal ignored when the process started stays ignored, as Python leaves SIGINT then: a shell
    ignores it in the jobs it starts in the background, so that Ctrl-C leaves them running."""
    if not _in_main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in signals if signal.getsignal(s) is not signal.SIG_IGN}


def _restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM raises Interrupted(SIGTERM) in the main thread, as SIGINT raises
    KeyboardInterrupt: context managers and `finally` blocks run (a run's directory lock, a server's
    drain) and the CLI says one line, where the default action ends the process without a word."""
    previous = _catch([signal.SIGTERM], _raise_interrupted)
    try:
        yield
    finally:
        _restore(previous)


def ignore_stop_signals(*_) -> None:
    """In a helper process (a DataLoader worker: its worker_init_fn; a tool worker): SIGINT and
    SIGTERM ignored. Ctrl-C reaches every process of the terminal's foreground group, and a
    scheduler's SIGTERM every process of the job; a helper killed by it would fail the step its
    trainer is finishing (torch's DataLoader raises when a worker dies of a signal). The trainer
    ends its helpers itself, and they end with it (a worker watches its parent; a tool worker
    reads the end of its stdin)."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


@contextlib.contextmanager
def sigint_sets(event: threading.Event) -> Iterator[None]:
    """While the block runs, Ctrl-C sets `event` (chat: the reply being generated stops at its next
    token, the conversation goes on) and a second Ctrl-C raises KeyboardInterrupt."""
    def handle(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = _catch([signal.SIGINT], handle)
    try:
        yield
    finally:
        _restore(previous)


def _say(text: str) -> None:
    """A line on stderr from a signal handler, written to the descriptor: the handler may run while
    the main thread is inside a write to sys.stderr's buffer (a progress bar), and a reentrant
    write into that buffer raises."""
    try:
        os.write(sys.stderr.fileno(), f"\n{text}\n".encode())
    except (AttributeError, OSError, ValueError):  # no descriptor (a replaced sys.stderr): said through it
        print(text, file=sys.stderr)


class StopSignals:
    """SIGINT and SIGTERM for the whole of a training run (see the module's docstring), from before
    its model loads: until `watch(run)` a signal stops at once (nothing to finish yet); from then
    on the first marks the stop, which the step loop asks about (`agreed`) after each step."""

    def __init__(self):
        self.run = None
        self.signum: int | None = None  # the first stop signal this process received while watching
        self.stopped_by: int | None = None  # the signal every rank stops on (agreed), once decided
        self._tallied: tuple[float, float] | None = None  # every rank's votes, from the step's all-reduce
        self._previous: dict = {}
        self._pid = os.getpid()

    def __enter__(self) -> "StopSignals":
        self._previous = _catch(STOP_SIGNALS, self._on_signal)
        return self

    def __exit__(self, kind, error, tb) -> None:
        """The handlers restored. A run stopped early ends here, after begin_run has let its ranks
        leave together: Interrupted with the message. A second Ctrl-C gets its message too."""
        _restore(self._previous)
        self._previous = {}
        if isinstance(error, KeyboardInterrupt) and getattr(error, "message", None) is None and self.run:
            signum = getattr(error, "signum", signal.SIGINT)
            raise Interrupted(signum, self._at_once_message(signum)) from None
        if error is None and self.early:
            raise Interrupted(self.stopped_by, self._stopped_message(), said=True)
        if error is None and self.signum is not None and self.run.t.world.main:
            print(f"({signal_name(self.signum)} arrived during the last step: the run is complete)", file=sys.stderr)

    def watch(self, run) -> None:
        """From now on a signal lets the step in progress finish: `run` (train/run.py's Run) is
        what a stop saves, with its steps, output directory and world."""
        self.run = run

    def _on_signal(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked helper before its own handlers were set: not the trainer's
            return
        if self.run is None:  # the model and data are still loading: nothing to finish or save
            raise Interrupted(signum)
        if self.signum is None:
            self.signum = signum
            if self.run.t.world.main:
                _say(self._notice(signum))
            return
        if signum == signal.SIGINT:  # a second Ctrl-C: now (a repeated SIGTERM changes nothing)
            raise Interrupted(signum)

    def vote(self) -> tuple[float, float]:
        """This process's vote for the step's all-reduce: (a SIGINT received, a SIGTERM received)."""
        return float(self.signum == signal.SIGINT), float(self.signum == signal.SIGTERM)

    def tally(self, sigint: float, sigterm: float) -> None:
        """Every rank's votes, summed by an all-reduce the step makes anyway (SFT's first one): the
        decision then costs no collective, and no host sync, of its own."""
        self._tallied = (sigint, sigterm)

    def agreed(self) -> bool:
        """After a step: whether to stop now, the same answer on every rank. One process: its own
        signal, the freshest. Several: the votes the step tallied, else one all-reduce of them here
        (GRPO: its step ends with host syncs already, rollouts hold many, so one more sync at its end
        costs no overlap; SFT's steps are short and keep the GPU's queue full, so they tally instead)."""
        world = self.run.t.world
        if world.size == 1:
            self.stopped_by = self.signum
            return self.stopped_by is not None
        sigint, sigterm = self._tallied if self._tallied is not None else world.sums(*self.vote())
        self._tallied = None
        self.stopped_by = signal.SIGTERM if sigterm else signal.SIGINT if sigint else None
        return self.stopped_by is not None

    @property
    def early(self) -> bool:
        """Stopped before the run's last step."""
        return self.stopped_by is not None and self.run.step < self.run.total_steps

    def checkpoint(self) -> None:
        """Stopped early: write checkpoint-STEP, unless finish_step just wrote it (it was due), and say
        so (rank 0, for every rank: they stopped after the same step)."""
        from vlforge.train.run import due

        run = self.run
        if not self.early:
            return
        if not due(run.cfg.train.save_every, run.step, run.total_steps):
            run.save()
        if run.t.world.main:
            print(self._stopped_message(), file=sys.stderr, flush=True)

    def _partial_save(self) -> Path | None:
        """The temporary directory of a checkpoint of this step being written (train/checkpoint.py
        names it after the step: with this process's pid, or alone when ranks write together)."""
        from vlforge.train.checkpoint import TMP_PREFIX

        out, step = self.run.out, self.run.step
        found = [p for p in (out / f"{TMP_PREFIX}{step}", out / f"{TMP_PREFIX}{step}-{self._pid}") if p.is_dir()]
        return found[0] if found else None

    def _notice(self, signum: int) -> str:
        name, code = signal_name(signum), 128 + signum
        now = (f"{name} received while checkpoint-{self.run.step} is being written: the save completes"
               if self._partial_save() else f"{name} received: the step in progress finishes, a checkpoint of it "
                                            "is written")
        return (f"{now}, then the run stops (exit code {code}). Ctrl-C again stops at once, keeping the "
                "finished checkpoints")

    def _stopped_message(self) -> str:
        run = self.run
        return (f"stopped by {signal_name(self.stopped_by)} after step {run.step} of {run.total_steps}: "
                f"{run.out / f'checkpoint-{run.step}'} is saved; rerun the same command with "
                "train.resume=auto to continue from it")

    def _at_once_message(self, signum: int) -> str:
        from vlforge.train.checkpoint import list_checkpoints

        run = self.run
        text = (f"stopped at once by a second {signal_name(signum)} after step {run.step} of {run.total_steps}: "
                "the steps since the last checkpoint are not saved")
        if partial := self._partial_save():
            text += (f"; checkpoint-{run.step} was being written and is not finished: its partial copy "
                     f"{partial.name} is never resumed from (the run's next save removes it)")
        finished = list_checkpoints(run.out)
        if finished:
            return (f"{text}; the last finished checkpoint, {finished[-1]}, is intact: rerun the same command "
                    "with train.resume=auto to continue from it")
        return f"{text}; no checkpoint of this run was finished yet, so a rerun starts from the beginning"
