"""The generation engine: prefill once, decode many steps from a preallocated KV cache, continuous batching.

    engine = engine_for(model)                       # one per model, kept with its buffers and graphs
    results = engine.generate([GenRequest(Prompt(ids, pixels, grid), n=8, max_new_tokens=256,
                                          temperature=1.0, seed=s)], stop_ids=encoder.end_ids,
                              banned_ids=vision_token_ids(encoder))

    engine.open(stop_ids=..., banned_ids=..., image_token_id=..., pad_id=...)   # or pull: add, step, cancel
    id = engine.add(GenRequest(...)); outputs = engine.step()   # StepOutput: id, new tokens, results

    feed = Feed(refill)                              # requests joining a running call (the server's)
    ticket = feed.put(GenRequest(...))               # from any thread; joins at the next sync point
    engine.generate([], ..., feed=feed, on_tokens=..., on_result=...)    # feed.finish(ticket) ends one

Shapes: S decode slots, L KV-cache length, Lb the filled part attention reads (a bucket), B
prompts of one prefill, V vocabulary, D head dim.

A call, in the order a request goes through the parts (transformers' own Qwen3-VL layers
throughout; nothing re-implemented but the cache, the decode attention call and, in fused.py, the
q/k/v and gate/up projections of a layer as one GEMM each):

- requests.py: the call's requests (each: one prompt, n samples) are checked and taken (with a
  Feed, also those put on it while the call runs).
- plan.py: what the call fixes is decided once into a Plan: a call whose requests all have
  n = G >= 2 (and no feed) uses GroupCache (each prompt's KV once for its G rows,
  `Engine(share_prompt=False)`: SlotCache always); CUDA graphs, the compiled step, fused
  projections, route recording.
- scheduler.py: at each sync point, waiting requests are admitted while free slots remain.
- runner.py (prefill.py): their images are encoded once, their prompts prefilled once
  (`forward_shared` with a DynamicCache, the model's own attention), each prompt's KV copied,
  left padding stripped, into its slots (cache.py); the first token is sampled from the prefill.
- runner.py (decode.py, cache.py, sampling.py): a decode step is the language model on [S, 1]
  with a 4-D additive mask (0 / dtype min) built once a step on the GPU from the per-row lengths
  (masking_utils returns a 4-D mask as given, so every layer's SDPA call takes it as it is),
  per-row M-RoPE positions, the cache's `update` writing each row at its own position, lm_head,
  banned tokens, sampling and per-row stop / max-token bookkeeping, all tensor ops: on CUDA it is
  captured once per (slot bucket, length bucket, sampling mode, plan) as a CUDA graph and replayed.
- scheduler.py: the host syncs every `sync_every` steps: finished rows leave (their slots are
  freed, `on_result` is called), waiting requests join, and with nobody waiting running rows move
  down into freed slots when the step's bucket shrinks.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from vlforge.generate.cache import LENGTH_BUCKET, bucket
from vlforge.generate.plan import Plan, cuda_autocast, graphs_possible, kv_dtype, kv_dtypes
from vlforge.generate.requests import Feed, GenRequest, GenResult, GenStats, StepOutput, check_request, \
    sampling_mode
from vlforge.generate.runner import MAX_STOP_IDS, Runner
from vlforge.generate.scheduler import Scheduler
from vlforge.model.tiers import unwrap


class Engine:
    """Generation for one model: its KV slots, decode state and CUDA graphs live across calls.

    use_graphs: None = on CUDA, unless torch.distributed runs several processes (FSDP2's hooks
    must run every forward); False = eager steps (the same code; CPU always).
    compile: torch.compile the decode step's language-model forward (fuses the layers' small
    elementwise ops: norms, rotary, activations; a graph of the eager layers is ~65 kernels per layer
    and bound by their count) and, apart, its logits-to-token part (decode.pick: the passes over [S, V]):
    1.9x faster steps on an H200 (2B, 64 rows: 7.4 -> 3.8 ms) for a compile of ~80-95 s, once per
    engine (dynamic shapes: one compile serves every bucket of 2 slots or more; its time counts in
    capture_s). Worth it for a GRPO run, not for one eval pass. Default for generate(compile=None).
    compact: at a sync point with nobody waiting, move running rows down into freed slots when that
    shrinks the step's slot bucket (Scheduler._compact); False keeps every row in its first slot.
    share_prompt: a call whose requests all have the same n >= 2 samples (and no feed) stores each
    prompt's KV once for its n rows (GroupCache) instead of a copy per row, so a decode step reads
    a prompt's KV once per group: less attention traffic (the prompt is most of a GRPO row's KV)
    and less KV memory; the same tokens (tested). False: SlotCache always.
    join_share: while rows run, waiting requests join only once this share of the call's slots is
    free (or as many as wait: one waiting request joins the first free slot, so a lone request never
    waits for it), for at most scheduler.MAX_JOIN_HOLD sync points, so that one prefill serves several joins.
    Measured on an H200 (2B, 256 requests of 16-512 tokens through 64 slots, joins at every sync
    point): 92 prefills of ~59 ms each took 5.4 s of the 11.3 s run, the decode steps 5.8 s
    (docs/benchmarks-log.md, 2026-12-02, "FSDP2 units at world size 1"). 0: join at every sync point where a slot freed.
    fuse_projections: each decoder layer's q/k/v projections, and its MLP's gate/up, computed as one
    GEMM each in the prefill and the decode steps (generate/fused.py; weights that need no gradient
    only: inference models, frozen LoRA bases and GRPO's rollout copies). False: one GEMM per
    projection, as transformers.
    """

    def __init__(self, model, *, max_slots: int = 256, sync_every: int = 8, use_graphs: bool | None = None,
                 compile: bool = False, max_prefill_tokens: int = 32768, compact: bool = True,
                 join_share: float = 0.125, share_prompt: bool = True, fuse_projections: bool = True):
        if not 0.0 <= join_share <= 1.0:
            raise ValueError(f"join_share: a share of the slots in [0, 1], got {join_share}")
        self.runner = Runner(unwrap(model))  # which holds the model by a weak reference
        self.max_slots, self.sync_every, self.use_graphs = max_slots, sync_every, use_graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.compile, self.compact, self.join_share = compile, compact, join_share
        self.share_prompt, self.fuse_projections = share_prompt, fuse_projections
        self.plan: Plan | None = None  # what the last call decided (read by tests and benchmarks)
        self.stats = GenStats()  # the last call's (the pull API: the running or last batch's)
        self._pull: PullSettings | None = None  # open()'s settings
        self._batch: Batch | None = None  # the pull API's running batch
        self._waiting: deque[tuple[int, GenRequest]] = deque()  # added, not yet in a batch
        self._results: dict[int, list[GenResult | None]] = {}  # id -> its rows' results (added, not finished)
        self._cancel: set[int] = set()
        self._new: dict[int, list[list[int]]] = {}  # this step's new tokens: id -> per sample
        self._finished: list[int] = []  # this step's
        self._next_id = 0

    @property
    def core(self):
        return self.runner.core

    @property
    def compile_failure(self) -> str | None:
        """Why the compiled decode step runs eager (its compile failed: decode.compiled_once); None if it
        compiled or was never tried."""
        return self.runner.compiled.failure if self.runner.compiled is not None else None

    def graphs_on(self, device) -> bool:
        """Whether this engine's decode steps run as CUDA graphs on `device`."""
        return graphs_possible(self.core, self.use_graphs, device)

    def release(self) -> None:
        """Free the KV slots and graphs (e.g. before a memory-hungry phase); the next call
        allocates and captures again (the compiled step is kept)."""
        self.runner.release()

    def reserve(self, slots: int, length: int, dtype: torch.dtype | None = None, group: int = 0) -> None:
        """Allocate the KV slots for `slots` rows of `length` positions now, so later calls up to that
        size reuse the same buffers and graphs (a larger call reallocates and recaptures). With
        `group` G: a GroupCache for calls of n = G samples a request (length: the longest prompt +
        G x max_new_tokens); one kind of buffer is held at a time, each kind's largest size is kept
        for when a call switches back (a compiled step compiles again for a new slot count)."""
        device = self.core.lm_head.weight.device
        slots = max(slots, 2 * max(group, 1) if self.compile else 1)  # compiled steps run at least 2 slots (groups)
        rows = group * bucket(math.ceil(slots / group)) if group else bucket(slots)
        self.runner.ensure_buffers(rows, LENGTH_BUCKET * math.ceil(length / LENGTH_BUCKET),
                                   dtype or kv_dtypes(self.core, self.runner.lm, device), device, group=group)

    @torch.no_grad()
    def generate(self, requests: list[GenRequest], *, stop_ids: list[int], banned_ids: list[int],
                 image_token_id: int, pad_id: int, slots: int | None = None,
                 on_result: Callable[[GenResult], None] | None = None,
                 on_tokens: Callable[[int, int, list[int]], None] | None = None,
                 compile: bool | None = None, feed: Feed | None = None,
                 record_routes: bool = False) -> list[GenResult]:
        """Results in request order (each request's n samples in turn). `slots` caps the decode
        batch (default: every sample at once, up to max_slots); `on_result` gets each result as
        soon as its row finishes (at a sync point); `on_tokens(request, sample, new_ids)` streams
        each row's new tokens at every sync point (one extra device-to-host copy per sync point,
        only when given; a result's streamed ids joined are its tokens); `compile`: this call's decode step compiled
        (default: the engine's `compile`; CUDA graphs only). `record_routes` (MoE): each result
        carries its tokens' top-k experts per layer (GenResult.routes, generate/routes.py).

        `feed`: requests come through it instead (`requests` must be empty; indices are the feed's
        tickets): those queued now are sized for, later ones join at sync points while they fit
        (see Feed); `slots` then defaults to max_slots. Returns when nothing runs or waits that fits.
        With a feed and an `on_result`, results go only to `on_result` and the call returns []: a fed
        call runs as long as requests come (a server), so it keeps nothing of an answered request."""
        if feed is not None and requests:
            raise ValueError("with a feed, every request comes through it (pass requests=[])")
        if self._batch is not None:  # its buffers and slots are in use
            raise RuntimeError("generate: a batch added with add() is still running (step() until it drains)")
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        taken = self._intake(requests, feed)
        if not taken:
            return []
        keep = feed is None or on_result is None  # the results are returned
        plan, sched = self._start(taken, slots, compile, feed is not None, record_routes, keep, on_result)
        taken = None  # a fed call may run as long as requests come: the scheduler alone holds them
        self.runner.prepare(plan, stop_ids, banned_ids, pad_id, sched.prompt_span)
        mode = sampling_mode(list(sched.requests.values()), "greedy")
        if feed is not None and (ended := feed._finished()):  # finished while queued: no prefill
            sched.finish_early(ended, [], self.runner)
        while sched.busy:
            if admitted := sched.admit():
                mode = sampling_mode([r for _, r, _ in admitted], mode)  # a joining request may need more than greedy
                self._prefill(admitted, plan, image_token_id, pad_id, mode)
                sched.prefilled(admitted)
                admitted = None  # a fed call holds no prefilled prompt (images)
            done = self._decode(plan, sched, mode, on_tokens) if sched.occupant else []
            if feed is not None:
                if feed.refill is not None:
                    feed.refill(feed)
                sched.join(feed._take(sched.fits))  # before the finishes: one finished while queued leaves unprefilled
                if ended := feed._finished():
                    done = sched.finish_early(ended, done, self.runner)
            if done:
                sched.finish(done, self.runner)
        return sched.collect()

    # -- the pull API: add requests, step the running batch, read its outputs ----------------------

    def open(self, *, stop_ids: list[int], banned_ids: list[int], image_token_id: int, pad_id: int,
             slots: int | None = None, compile: bool | None = None, record_routes: bool = False) -> None:
        """The settings add/step run with (generate's per-call arguments, same meanings; `slots` defaults to
        max_slots); a change applies from the next running batch (see step)."""
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        self._pull = PullSettings(tuple(stop_ids), tuple(banned_ids), image_token_id, pad_id, slots, compile,
                                  record_routes)

    def add(self, request: GenRequest) -> int:
        """Queue a request (its n samples: one id) for the next step; returns its id. add, cancel and step
        are called from one thread (the caller's loop)."""
        if self._pull is None:
            raise RuntimeError("Engine.add: call open(stop_ids=..., ...) first")
        check_request(self._next_id, request)
        if request.n > (cap := bucket(min(self._pull.slots or self.max_slots, self.max_slots))):
            raise ValueError(f"a request asks for {request.n} samples; the engine has {cap} slots")
        id, self._next_id = self._next_id, self._next_id + 1
        self._waiting.append((id, request))
        self._results[id] = [None] * request.n
        return id

    def cancel(self, id: int) -> None:
        """End a request at the next step: its rows stop and free their slots before that step admits
        anyone; its output says cancelled (unknown or finished ids: nothing)."""
        if id in self._results:
            self._cancel.add(id)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One step of the running batch, then what it produced. A step: cancelled requests leave (their
        slots freed); waiting requests join the running batch while they fit its KV length (in order:
        one that does not waits, with those behind it, until the batch drains; with no batch running,
        a new one starts, its Plan and buffers decided for the requests waiting then); the scheduler
        admits those it has slots for, and they are prefilled (first token sampled); then `sync_every`
        decode steps and their sync point (generate's cadence: one host read per step, plus the copy of
        the new tokens); finished rows leave. A request added between steps thus decodes in the next
        step when a slot is free (Engine(sync_every=1): one decode step a step)."""
        cancelled, self._cancel, self._new, self._finished = self._cancel, set(), {}, []
        for id, r in [(i, r) for i, r in self._waiting if i in cancelled]:  # never in a batch: empty results
            self._waiting.remove((id, r))
            for s in range(r.n):
                self._answered(GenResult(id, s, torch.zeros(0, dtype=torch.long), torch.zeros(0), False))
        self._join_waiting()
        if (b := self._batch) is not None:
            sched, runner = b.sched, self.runner
            running = set(sched.queue) | {t for t, _ in sched.occupant.values()}
            if (ended := cancelled & running) and (done := sched.finish_early(ended, [], runner)):
                sched.finish(done, runner)
            if admitted := sched.admit():
                b.mode = sampling_mode([r for _, r, _ in admitted], b.mode)
                self._prefill(admitted, b.plan, b.settings.image_token_id, b.settings.pad_id, b.mode)
                sched.prefilled(admitted)
            if done := self._decode(b.plan, sched, b.mode, self._streamed) if sched.occupant else []:
                sched.finish(done, runner)
            if not sched.busy:
                self._batch = None  # drained: the next request starts a batch of its own Plan
        return [self._output(id, id in cancelled) for id in sorted(set(self._new) | set(self._finished))]

    def _join_waiting(self) -> None:
        if not self._waiting:
            return
        if self._batch is None:
            s = self._pull
            plan, sched = self._start(dict(self._waiting), s.slots, s.compile, True, s.record_routes, False,
                                      self._answered)
            self.runner.prepare(plan, list(s.stop_ids), list(s.banned_ids), s.pad_id, sched.prompt_span)
            self._batch = Batch(plan, sched, s)
            self._waiting.clear()
        else:
            taken = []
            while self._waiting and self._batch.sched.fits(self._waiting[0][1]):
                taken.append(self._waiting.popleft())
            self._batch.sched.join(taken)

    def _output(self, id: int, cancelled: bool) -> StepOutput:
        new = tuple(tuple(ids) for ids in self._new.get(id, [[] for _ in self._results[id]]))
        return StepOutput(id, new, tuple(self._results.pop(id)) if id in self._finished else (), cancelled)

    def _streamed(self, id: int, sample: int, ids: list[int]) -> None:
        self._new.setdefault(id, [[] for _ in self._results[id]])[sample] += ids

    def _answered(self, res: GenResult) -> None:
        per = self._results[res.request]
        per[res.sample] = res
        if all(r is not None for r in per):
            self._finished.append(res.request)

    def _intake(self, requests: list[GenRequest], feed: Feed | None) -> dict[int, GenRequest]:
        """The call's first requests, checked, by ticket (without a feed: the position in `requests`)."""
        if feed is not None and feed.refill is not None:
            feed.refill(feed)
        taken = feed._take(lambda r: True) if feed is not None else list(enumerate(requests))
        for t, r in taken:
            check_request(t, r)
        return dict(taken)

    def _start(self, requests: dict[int, GenRequest], slots: int | None, compile: bool | None, fed: bool,
               record_routes: bool, keep: bool, on_result) -> tuple[Plan, Scheduler]:
        """The call's plan, its KV buffers (sized for the requests known now) and its scheduler (`fed`:
        more requests may join while it runs)."""
        device = self.core.lm_head.weight.device
        total = sum(r.n for r in requests.values())
        n_slots = bucket(min(slots or self.max_slots, self.max_slots, self.max_slots if fed else total))
        if max(r.n for r in requests.values()) > n_slots:
            raise ValueError(f"a request asks for {max(r.n for r in requests.values())} samples; the engine has "
                             f"{n_slots} slots (raise slots / max_slots)")
        if record_routes and self.runner.recorder is None:
            raise ValueError("record_routes: the model has no mixture-of-experts router to record")
        self.plan = plan = self._plan(requests, fed, compile, record_routes, device)
        kv = kv_dtypes(self.core, self.runner.lm, device)
        prompt_span = max(len(r.prompt.input_ids) for r in requests.values())
        if G := plan.group:  # groups: a step runs a bucket of them (a compiled one at least 2)
            need = prompt_span + G * max(r.max_new_tokens for r in requests.values())
            rows = G * plan.step_groups(n_slots // G)
        else:
            need = max(len(r.prompt.input_ids) + r.max_new_tokens for r in requests.values())
            rows = max(n_slots, plan.step_slots(1))
        self.runner.ensure_buffers(rows, LENGTH_BUCKET * math.ceil(need / LENGTH_BUCKET), kv, device, group=G)
        self.stats = GenStats()
        return plan, Scheduler(requests, n_slots, self.runner.cache.length, prompt_span, plan, self.stats,
                               join_share=self.join_share, max_prefill_tokens=self.max_prefill_tokens,
                               compact=self.compact, fed=fed, keep=keep, on_result=on_result)

    def _plan(self, requests: dict[int, GenRequest], fed: bool, compile: bool | None, record_routes: bool,
              device) -> Plan:
        graphs = self.graphs_on(device)
        sizes = {r.n for r in requests.values()}
        # before the weights' storage is read below: a first call makes the fused weights views of one buffer
        fusing = self.fuse_projections and self.runner.fuse()
        return Plan(
            # every request n = G >= 2 samples, all known now (GRPO, eval with n > 1): a GroupCache, each
            # prompt's KV read once per group
            group=min(sizes) if self.share_prompt and not fed and len(sizes) == 1 and min(sizes) >= 2 else 0,
            graphs=graphs, compiled=graphs and (compile if compile is not None else self.compile), fusing=fusing,
            recording=bool(record_routes), weights=hash(tuple(p.data_ptr() for p in self.core.parameters())),
            mask_dtype=kv_dtype(self.runner.lm, device), training=self.core.training, autocast=cuda_autocast(),
            fp8=self.runner.fp8 is not None)

    def _prefill(self, admitted: list[tuple[int, GenRequest, list[int]]], plan: Plan, image_token_id: int,
                 pad_id: int, mode: str) -> None:
        start = time.perf_counter()
        self.runner.prefill(plan, admitted, image_token_id, pad_id, mode)
        self.stats.prefills += 1
        self.stats.prefill_s += _elapsed(start, self.runner.cache.rows.device)

    def _decode(self, plan: Plan, sched: Scheduler, mode: str, on_tokens) -> list[int]:
        """sync_every decode steps over the occupied slots, then the sync point: the slots whose rows finished."""
        steps = self.sync_every
        S, Lb = sched.shape(steps)
        start = time.perf_counter()
        self.runner.run_steps(plan, S, Lb, mode, steps, self.stats)
        self.stats.row_steps += S * steps
        sched.advance(steps)
        alive = self.runner.alive(S)  # the sync point
        self.stats.decode_s += time.perf_counter() - start
        self.stats.steps += steps
        if on_tokens is not None:
            sched.stream(self.runner, S, on_tokens)
        return [slot for slot in sched.occupant if not alive[slot]]


@dataclass(frozen=True)
class PullSettings:
    """Engine.open's: what generate takes per call, for the pull API's batches."""
    stop_ids: tuple[int, ...]
    banned_ids: tuple[int, ...]
    image_token_id: int
    pad_id: int
    slots: int | None
    compile: bool | None
    record_routes: bool


@dataclass
class Batch:
    """The pull API's running batch: its Plan and scheduler live until it drains."""
    plan: Plan
    sched: Scheduler
    settings: PullSettings  # open()'s when it started
    mode: str = "greedy"  # the sampling mode its steps run (raised as requests needing more join)


def _elapsed(start: float, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(model, **kwargs) -> Engine:
    """The model's engine (created on first use; its buffers and CUDA graphs are reused by later
    calls, e.g. every GRPO step). kwargs apply when it is created."""
    core = unwrap(model)
    engine = _ENGINES.get(core)
    if engine is None:
        engine = _ENGINES[core] = Engine(model, **kwargs)
    return engine
