"""The scheduler: one batch's bookkeeping of requests and slots, on the host (no device reads).

It keeps a queue of requests and a fixed set of slots. At each step it admits waiting requests
(each: one prompt, n samples) while free slots remain (it knows which: it freed them), holding them
for a fuller prefill while rows run if the engine's `join_share` asks (counted in sync points); it
says how many slots and KV positions the next step runs (a bucket each); at a sync point finished
rows leave (their results and any tokens not streamed yet to the outputs, their slots freed: a
GroupCache's whole group with its last row), and with nobody waiting, running rows move down into
freed slots when that shrinks the step's bucket (compaction). A row's tokens do not depend on which other rows share its steps
(per-row positions and masks, per-row noise), so joining mid-batch changes nothing.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from vlforge.generate.cache import LENGTH_BUCKET
from vlforge.generate.plan import Plan
from vlforge.generate.requests import GenRequest, GenResult, GenStats, Outputs
from vlforge.generate.runner import Runner

MAX_JOIN_HOLD = 4  # sync points waiting requests are held for a fuller prefill at most (Engine.join_share)


class Scheduler:
    def __init__(self, requests: dict[int, GenRequest], slots: int, length: int, prompt_span: int, plan: Plan,
                 stats: GenStats, outputs: Outputs, *, stream: bool, join_share: float,
                 max_prefill_tokens: int, step_prefill_tokens: int, compact: bool, closed: bool):
        # by id; a batch may run as long as requests come: a request leaves `requests` once prefilled
        # (its images with it), and each result goes to `outputs` as its row finishes (with `stream`, the
        # rows' new tokens too)
        self.requests = requests
        self.queue = deque(requests)
        self.slots, self.length, self.prompt_span, self.plan, self.stats = slots, length, prompt_span, plan, stats
        G = plan.group
        self.free = list(range(G * (slots // G) if G else slots))  # GroupCache: whole groups only
        self.ended_in_group: dict[int, int] = {}  # GroupCache: group -> rows finished (its slots free with the last)
        self.occupant: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)
        self.sent: dict[int, int] = {}  # slot -> tokens already streamed
        self.bound: dict[int, int] = {}  # slot -> an upper bound of its KV length (host-side, no sync)
        self.prompt_len: dict[int, int] = {}  # slot -> its prompt's length
        self.join_at = max(1, int(slots * join_share))  # free slots that make a prefill worth it while rows run
        self.held = 0  # sync points the waiting requests have been held for
        self.max_prefill_tokens, self.compact, self.closed = max_prefill_tokens, compact, closed
        self.step_prefill_tokens = step_prefill_tokens
        self.outputs, self.streaming = outputs, stream

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.occupant)

    # -- admission ------------------------------------------------------------------------------

    def fits(self, r: GenRequest) -> bool:
        """Whether a request can join this running batch: it is open to joins (not `closed`: a GroupCache's
        layout is fixed by the requests it started with) and the request fits its KV length and slots."""
        return not self.closed and len(r.prompt.input_ids) + r.max_new_tokens <= self.length and r.n <= self.slots

    def join(self, taken: list[tuple[int, GenRequest]]) -> None:
        """Requests added while the batch runs join its queue."""
        for t, r in taken:
            self.requests[t] = r
            self.queue.append(t)

    def admit(self, count_hold: bool = True) -> list[tuple[int, GenRequest, list[int]]]:
        """The waiting requests that take free slots now, with their slots (one prefill's worth).
        `count_hold`: this step follows a sync point (slots free there), so a hold counts one more."""
        queue, requests, free = self.queue, self.requests, self.free
        admitted, tokens = [], 0
        # joins wait for join_at free slots (or as many as all the waiting samples need), for at most
        # MAX_JOIN_HOLD sync points: slots free only as rows end, which long rows may not for a long time
        can_join = bool(queue) and requests[queue[0]].n <= len(free)
        hold = (can_join and bool(self.occupant) and self.held < MAX_JOIN_HOLD
                and len(free) < min(self.join_at, sum(requests[q].n for q in queue)))
        self.held = (self.held + count_hold) if hold else 0
        # interleaved prefill: while rows decode, one step prefills at most step_prefill_tokens (one request
        # at least), so a burst of joins costs the running rows a few short stalls rather than one long one
        budget = min(self.max_prefill_tokens, self.step_prefill_tokens) if self.occupant else self.max_prefill_tokens
        while queue and not hold and requests[queue[0]].n <= len(free):
            r = requests[queue[0]]
            if admitted and tokens + len(r.prompt.input_ids) > budget:
                break
            i = queue.popleft()
            free.sort()
            sl, free[:] = free[:r.n], free[r.n:]
            admitted.append((i, r, sl))
            tokens += len(r.prompt.input_ids)
            for s, slot in enumerate(sl):
                self.occupant[slot] = (i, s)
                self.bound[slot] = self.prompt_len[slot] = len(r.prompt.input_ids)
                self.sent[slot] = 0
        return admitted

    def prefilled(self, admitted: list[tuple[int, GenRequest, list[int]]]) -> None:
        for i, _, _ in admitted:  # the batch may run as long as requests come: it holds no prefilled prompt (images)
            del self.requests[i]

    # -- decoding -------------------------------------------------------------------------------

    def shape(self, steps: int) -> tuple[int, int]:
        """(S, Lb) of the next `steps` steps: the slot bucket over the occupied slots and the length
        bucket attention reads (past every row's KV after those steps)."""
        occupant, bound, G = self.occupant, self.bound, self.plan.group
        if G:  # the rows' generated tokens, G to a position step, after the call's prompt span
            S = G * self.plan.step_groups(max(occupant) // G + 1)
            suffix = max(bound[s] - self.prompt_len[s] for s in occupant)
            span = LENGTH_BUCKET * max(1, G // 2)  # ~LENGTH_BUCKET / 2 positions a row at most unread
            return S, min(self.length, span * math.ceil((self.prompt_span + G * (suffix + steps)) / span))
        S = self.plan.step_slots(max(occupant) + 1)
        return S, min(self.length, LENGTH_BUCKET * math.ceil((max(bound.values()) + steps) / LENGTH_BUCKET))

    def advance(self, steps: int) -> None:
        for slot in self.occupant:
            self.bound[slot] += steps

    def stream(self, runner: Runner, S: int) -> None:
        """Each running row's tokens not streamed yet to the outputs (one copy of the new columns)."""
        counts = runner.state.count[:S].cpu()
        width = max((int(counts[slot]) for slot in self.occupant), default=0)  # freed slots keep old counts
        lo = min((self.sent[slot] for slot in self.occupant), default=0)  # only columns not streamed yet cross
        toks = runner.state.out_tok[:S, lo:width].cpu()
        for slot, (i, s) in self.occupant.items():
            n = int(counts[slot])
            if n > self.sent[slot]:
                self.outputs.streamed(i, s, toks[slot, self.sent[slot] - lo:n - lo].tolist())
                self.sent[slot] = n

    # -- finishing ------------------------------------------------------------------------------

    def finish_early(self, ended: set[int], runner: Runner) -> list[int]:
        """Cancelled requests: their rows stop (returned: finish them); those not started yet leave the
        queue with empty results."""
        rows = [slot for slot, (t, _) in self.occupant.items() if t in ended]
        if rows:
            runner.stop_rows(rows)
        for t in [t for t in self.queue if t in ended]:
            self.queue.remove(t)
            for s in range(self.requests.pop(t).n):
                self.outputs.answered(GenResult(t, s, torch.zeros(0, dtype=torch.long), torch.zeros(0), False))
        return rows

    def finish(self, done: list[int], runner: Runner) -> None:
        """Finished rows leave: their results answered, their slots freed; then compaction."""
        if not done:
            return
        for slot, (tokens, logprobs, stopped, routes) in zip(done, runner.harvest(done, self.plan)):
            i, s = self.occupant[slot]
            self.stats.tokens += len(tokens)
            if self.streaming and len(tokens) > self.sent[slot]:  # a row cancelled between sync points
                self.outputs.streamed(i, s, tokens[self.sent[slot]:].tolist())
            self.outputs.answered(GenResult(i, s, tokens, logprobs, stopped, routes))
        for slot in done:
            del self.occupant[slot], self.bound[slot], self.prompt_len[slot], self.sent[slot]
        G = self.plan.group
        if G:  # a group's slots free together, with its last row (a joining request takes a whole group)
            for slot in done:
                self.ended_in_group[slot // G] = self.ended_in_group.get(slot // G, 0) + 1
                if self.ended_in_group[slot // G] == G:
                    self.free += range(slot // G * G, slot // G * G + G)
                    del self.ended_in_group[slot // G]
            if self.compact and not self.queue:
                self._compact_groups(runner)
        else:
            self.free += done
            if self.compact and not self.queue:
                self._compact(runner)

    def _compact(self, runner: Runner) -> None:
        """Move running rows from slots at or past len(occupant) into the free slots below it, when
        that makes the step's slot bucket smaller: a step computes every slot up to the highest
        occupied one, so without this a batch's long tail (the last rows of a mixed-length GRPO
        group, a long serve request) runs at the bucket its first step had. Costs one copy of the
        moved rows' filled KV (every layer) and their state. The rows' tokens are unchanged (tested in
        fp32); in bf16 a smaller batch may run other GEMM kernels, whose rounding can change later
        tokens, as any change of batch size can."""
        occupant, n = self.occupant, len(self.occupant)
        if not n or self.plan.step_slots(max(occupant) + 1) <= self.plan.step_slots(n):
            return
        movers = sorted(s for s in occupant if s >= n)
        holes = sorted(s for s in range(n) if s not in occupant)[:len(movers)]
        filled = min(self.length, max(self.bound[s] for s in movers))  # KV past it is never read
        runner.move_rows(movers, holes, filled, self.plan)
        for s, d in zip(movers, holes):
            self._move(s, d)
        self.free[:] = sorted((set(self.free) - set(holes)) | set(movers))
        self.stats.compactions += 1

    def _compact_groups(self, runner: Runner) -> None:
        """_compact for a GroupCache: whole groups (their prompt's KV and their rows' tokens) move into
        free groups below, when that makes the step's group bucket smaller."""
        G, occupant = self.plan.group, self.occupant
        live = sorted({slot // G for slot in occupant})
        n = len(live)
        if not n or self.plan.step_groups(live[-1] + 1) <= self.plan.step_groups(n):
            return
        movers = [g for g in live if g >= n]
        holes = [g for g in range(n) if g not in live][:len(movers)]
        suffix = max(self.bound[s] - self.prompt_len[s] for s in occupant if s // G in movers)
        filled = min(self.length + 1, self.prompt_span + G * (suffix + 1))  # past it nothing was written
        rows = [(g * G + i, h * G + i) for g, h in zip(movers, holes) for i in range(G)]
        runner.move_groups(movers, holes, filled, rows, self.plan)
        for a, b in rows:
            if a in occupant:  # a finished row of a moving group has left occupant already
                self._move(a, b)
        for g, h in zip(movers, holes):
            if g in self.ended_in_group:
                self.ended_in_group[h] = self.ended_in_group.pop(g)
        moved_from = {a for a, _ in rows}
        taken = {b for _, b in rows}
        self.free[:] = sorted((set(self.free) - taken) | moved_from)
        self.stats.compactions += 1

    def _move(self, a: int, b: int) -> None:
        """A row's bookkeeping from slot a to slot b."""
        for book in (self.occupant, self.bound, self.sent, self.prompt_len):
            book[b] = book.pop(a)
