"""The batcher: one background thread owns the vlm and runs its pull API in a loop: it adds the
waiting requests while fewer than `max_batch` run (after a gather window of a few ms when idle, so
that a burst shares a prefill), calls `vlm.step()`, and forwards each step's TextOutputs to their
jobs (by the engine's id, the one id of a request): new text to the job's asyncio queue through
`loop.call_soon_threadsafe`, the Completion as its answer. A request added between steps decodes in
the next one; each finished one answers at once.

A job whose client goes away is cancelled (`Job.cancel`): skipped if it has not been added, else
the vlm stops its row at the next step (it checks `Request.cancelled`) while the others go on.

Shutting down (`draining`): new jobs are refused (503) while the accepted ones finish (`unfinished`
counts them); `abort()` then cancels what is left, and those clients get `ShuttingDown` (503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vlforge.infer.model import Request
from vlforge.serve.schema import APIError

log = logging.getLogger("vlforge.serve")


class ShuttingDown(RuntimeError):
    """A job the server did not finish because it is shutting down (answered 503)."""


@dataclass(eq=False)
class Job:
    request: Request
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.monotonic)  # when the request reached the server
    prompt: Any = None  # vlm.prepare(request): its ids and pixels, made off this thread (None: made at add)
    first_text_at: float | None = None  # when its first text was generated (streamed or not)
    aborted: bool = False  # cancelled by the server's shutdown, not by its client

    @property
    def cancelled(self) -> bool:
        return self.request.cancelled.is_set()

    def cancel(self) -> None:
        """The client went away: skip the job, or stop its row of the running batch."""
        self.request.cancelled.set()

    def abort(self) -> None:
        """The server shuts down: the job stops as a cancelled one, and its client is told why."""
        self.aborted = True
        self.request.cancelled.set()

    def emit(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (shutdown)
            pass


class Batcher:
    """A single thread owning the vlm: adds waiting jobs to it and steps it (module docstring)."""

    def __init__(self, vlm, max_batch: int = 8, window_s: float = 0.005, max_queue: int = 64, metrics=None):
        self.vlm, self.max_batch, self.window_s, self.max_queue = vlm, max_batch, window_s, max_queue
        self.metrics = metrics  # a ServeMetrics, or None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.batches = 0  # groups of requests added to the engine together (between two steps)
        self.max_batch_seen = 0  # the most requests generating at once
        self.requests_done = 0
        self.skipped = 0  # requests whose client left before their batch started
        self.running = 0  # requests being generated now
        self.cancelled = 0  # requests whose client left while their batch ran (their row stopped early)
        self.cancelled_tokens = 0  # tokens generated for those before they stopped
        self.draining = False  # shutting down: new jobs are refused
        self.aborted = False  # the drain timed out: the unfinished jobs were cancelled
        self._open: set[Job] = set()  # jobs submitted and not answered yet
        self._open_lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def unfinished(self) -> int:
        """Jobs accepted and not answered yet (queued, gathering or generating)."""
        return len(self._open)

    def stats(self) -> dict:
        return {"queue": self.waiting, "running": self.running, "batches": self.batches,
                "max_batch_seen": self.max_batch_seen, "requests": self.requests_done, "skipped": self.skipped,
                "cancelled": self.cancelled, "cancelled_tokens": self.cancelled_tokens}

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="vlforge-batcher", daemon=True)
                self._thread.start()

    def check_room(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry later", code="shutting_down")
        if self.waiting >= self.max_queue:
            raise APIError(503, f"the server is busy ({self.waiting} requests waiting); retry later",
                           code="queue_full")

    def submit(self, job: Job) -> None:
        with self._open_lock:  # atomic with close(): no job lands behind its stop sentinel
            self.check_room()
            self.start()
            self._open.add(job)
            self._queue.put(job)

    def abort(self) -> None:
        """Cancel every unfinished job (shutdown): running rows stop at the next step, queued
        jobs are answered without running; their clients get ShuttingDown."""
        self.draining = self.aborted = True
        with self._open_lock:
            jobs = list(self._open)
        for job in jobs:
            job.abort()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread once the jobs it runs are done (waiting at most `timeout` s); jobs still
        queued are answered ShuttingDown."""
        with self._open_lock:
            self.draining = True
            running = self._thread is not None and self._thread.is_alive()
            if running:
                self._queue.put(None)
        if running:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the generation thread did not stop within %g s; exiting without it", timeout)

    def _answer(self, job: Job, kind: str, payload: Any) -> None:
        """The job's last event ("done" or "error"): it is no longer unfinished."""
        job.emit(kind, payload)
        with self._open_lock:
            self._open.discard(job)

    def _skip(self, job: Job) -> None:
        """A cancelled job leaves before it runs: its client left (nobody to answer), or the server
        aborted it (answered ShuttingDown)."""
        if job.aborted:
            self._answer(job, "error", ShuttingDown("the server shut down before this request started"))
        else:
            self.skipped += 1
            with self._open_lock:
                self._open.discard(job)

    def _gather(self, first: Job) -> tuple[list[Job], bool]:
        batch, stop = [first], False
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:  # after the window, still take what is already waiting
                job = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                stop = True
                break
            batch.append(job)
        return batch, stop

    def _run(self) -> None:
        self.vlm.open(self.max_batch)
        jobs: dict[int, Job] = {}  # the engine's id -> its job, while it generates
        stopping = False
        while jobs or not stopping:
            if not stopping:
                stopping = self._take(jobs)
            if jobs:
                self._step(jobs)
        while True:  # shutting down: answer whoever is still waiting
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._answer(job, "error", ShuttingDown("the server shut down before this request started"))

    def _take(self, jobs: dict[int, Job]) -> bool:
        """Add waiting jobs while fewer than max_batch run (idle: wait for one, then a gather window);
        True once the shutdown sentinel was taken (the running jobs finish, the waiting are answered)."""
        if not jobs:
            first = self._queue.get()
            if first is None:
                return True
            group, stop = self._gather(first)
        else:
            group, stop = [], False
            while len(jobs) + len(group) < self.max_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                group.append(job)
        added = 0
        for job in group:
            if job.cancelled:
                self._skip(job)
                continue
            try:
                jobs[self.vlm.add(job.request, job.prompt)] = job
                added += 1
            except Exception as e:  # noqa: BLE001 - a request that cannot be prepared fails alone
                log.warning("request failed before it joined the batch: %s", e)
                if self.metrics is not None:
                    self.metrics.generations.labels("error").inc()
                self.requests_done += 1
                self._answer(job, "error", e)
        if added:
            self.batches += 1
            self.running = len(jobs)
            self.max_batch_seen = max(self.max_batch_seen, len(jobs))
            if self.metrics is not None:
                self.metrics.batch_size.observe(added)
        return stop

    def _step(self, jobs: dict[int, Job]) -> None:
        """One vlm step: each job's new text out, each finished job answered."""
        try:
            outputs = self.vlm.step()
        except Exception as e:  # noqa: BLE001 - answered to each client; the server keeps serving
            log.exception("generation failed with %d requests running", len(jobs))
            if self.metrics is not None:
                self.metrics.generations.labels("error").inc(len(jobs))
            failed = list(jobs.values())
            jobs.clear()
            self.running = 0
            self.requests_done += len(failed)
            for j in failed:
                self._answer(j, "error", e)
            return
        for o in outputs:
            job = jobs[o.id]
            if o.text:
                if job.first_text_at is None:  # time to first token, streamed or not
                    job.first_text_at = time.monotonic()
                if job.stream:
                    job.emit("text", o.text)
            if o.completion is not None:
                self._finished(jobs, o.id, o.completion)

    def _finished(self, jobs: dict[int, Job], id: int, c) -> None:
        job = jobs.pop(id)
        if c.finish_reason == "cancelled":
            self.cancelled += 1
            self.cancelled_tokens += c.completion_tokens
        if self.metrics is not None:
            self.metrics.finished(job, c, time.monotonic())
        # stats first: a client that has its answer sees them counted
        self.running = len(jobs)
        self.requests_done += 1
        self._answer(job, "done", c)


__all__ = ["Batcher", "Job", "ShuttingDown"]
