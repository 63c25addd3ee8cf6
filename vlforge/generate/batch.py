"""The pull API's running batch and what its steps report, on the host.

A Batch is the requests decoding together under one Plan (its scheduler holds their slots); it lives
from the step that starts it until it drains. Outputs keeps, by the id Engine.add returned, each
added request's results until all its rows have finished, and the tokens streamed since the last
step, and turns them into that step's StepOutputs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from vlforge.generate.plan import Plan
from vlforge.generate.requests import GenRequest, GenResult, StepOutput
from vlforge.generate.scheduler import Scheduler


MAX_PASSED = 128  # steps (16 sync points at sync_every 8) that later requests may join past one that does not fit


def take_fitting(waiting: deque, fits: Callable[[GenRequest], bool], passed: dict[int, int]) -> list:
    """The waiting (id, request)s that fit the running batch, taken out of `waiting` in order. One that
    does not fit (its prompt and answer are longer than the batch's KV) is passed over, counted in
    `passed`, until it has been passed MAX_PASSED times: from then on nothing joins, the batch drains
    and the next one is sized for it (so one long request neither holds up the short ones behind it
    nor waits for ever)."""
    taken, kept = [], deque()
    for id, r in waiting:
        if fits(r) and not any(passed.get(k, 0) > MAX_PASSED for k, _ in kept):
            taken.append((id, r))
            continue
        kept.append((id, r))
    if taken:
        for id, _ in kept:
            passed[id] = passed.get(id, 0) + 1
    for id, _ in taken:
        passed.pop(id, None)
    waiting.clear()
    waiting.extend(kept)
    return taken


@dataclass(frozen=True)
class BatchSettings:
    """Engine.open's: what every batch started after it runs with."""
    stop_ids: tuple[int, ...]
    banned_ids: tuple[int, ...]
    image_token_id: int
    pad_id: int
    slots: int | None
    compile: bool | None
    record_routes: bool
    share_prompt: bool  # a closed batch of n = G >= 2 requests shares each prompt's KV (GroupCache)
    stream: bool  # steps report new tokens (else results only)


@dataclass
class Batch:
    """The running batch: its Plan and scheduler live until it drains."""
    plan: Plan
    sched: Scheduler
    settings: BatchSettings  # open()'s when it started
    mode: str = "greedy"  # the sampling mode its steps run (raised as requests needing more join)
    since_sync: int = 0  # decode steps since its last sync point


class Outputs:
    """Each added request's rows' results (until all have finished) and this step's news, by id."""

    def __init__(self):
        self.results: dict[int, list[GenResult | None]] = {}  # id -> its rows' results (added, not finished)
        self.new: dict[int, list[list[int]]] = {}  # this step's new tokens: id -> per sample
        self.finished: list[int] = []  # this step's

    def added(self, id: int, n: int) -> None:
        self.results[id] = [None] * n

    def streamed(self, id: int, sample: int, ids: list[int]) -> None:
        self.new.setdefault(id, [[] for _ in self.results[id]])[sample] += ids

    def answered(self, res: GenResult) -> None:
        per = self.results[res.request]
        per[res.sample] = res
        if all(r is not None for r in per):
            self.finished.append(res.request)

    def unstarted(self, id: int) -> None:
        """A request that ends before any prefill (cancelled while waiting): empty results."""
        for s in range(len(self.results[id])):
            self.answered(GenResult(id, s, torch.zeros(0, dtype=torch.long), torch.zeros(0), False))

    def take(self, cancelled: set[int]) -> list[StepOutput]:
        """This step's outputs, by id; the finished requests are forgotten."""
        out = []
        for id in sorted(set(self.new) | set(self.finished)):
            new = tuple(tuple(ids) for ids in self.new.get(id, [[] for _ in self.results[id]]))
            done = tuple(self.results.pop(id)) if id in self.finished else ()
            out.append(StepOutput(id, new, done, id in cancelled))
        self.new, self.finished = {}, []
        return out
