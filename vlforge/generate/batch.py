"""The running batch, on the host: the requests decoding together under one Plan (its scheduler
holds their slots), from the step that starts it until it drains; the settings it started with;
and which waiting requests may join it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from vlforge.generate.plan import Plan
from vlforge.generate.requests import GenRequest
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
