"""The generation engine: prefill once, decode many steps from a preallocated KV cache, continuous batching.

    engine = Engine(model)                           # its owner's (the GRPO run, the InferenceModel)
    engine.open(stop_ids=encoder.end_ids, banned_ids=vision_token_ids(encoder),
                image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, slots=32)
    id = engine.add(GenRequest(Prompt(ids, pixels, grid), max_new_tokens=256))   # from the caller's loop
    outputs = engine.step()                          # StepOutput: id, new tokens, results once done
    engine.cancel(id)                                # its rows stop and free their slots at the next step

    results = engine.generate([GenRequest(prompt, n=8, temperature=1.0, seed=s)], stop_ids=..., ...)
                                                     # batch callers: open, add all, step until done

Shapes: S decode slots, L KV-cache length, Lb the filled part attention reads (a bucket), B
prompts of one prefill, V vocabulary, D head dim.

A request's path through the parts (transformers' own Qwen3-VL layers throughout; nothing
re-implemented but the cache, the decode attention call and, in fused.py, the q/k/v and gate/up
projections of a layer as one GEMM each):

- requests.py: `add` checks the request (one prompt, n samples) and queues it under a new id.
- batch.py: at the next `step` it joins the running batch when it fits (its KV length; a longer one
  waits for the batch to drain, passed by later ones at most MAX_PASSED steps), or starts one:
- plan.py: what a batch fixes is decided once into a Plan: a closed batch whose requests all have
  n = G >= 2 (open(share_prompt=True): generate) uses GroupCache (each prompt's KV once for its G
  rows); CUDA graphs, the compiled step, fused projections, route recording.
- scheduler.py: the request takes free slots (the host knows which: it freed them), in that same step.
- runner.py (prefill.py): its images are encoded once, its prompt prefilled (`forward_shared` with a
  DynamicCache, the model's own attention), the KV copied, left padding stripped, into its slots
  (cache.py); the first token is sampled from the prefill.
- runner.py (decode.py, cache.py, sampling.py): a decode step is the language model on [S, 1]
  with a 4-D additive mask (0 / dtype min) built once a step on the GPU from the per-row lengths
  (masking_utils returns a 4-D mask as given, so every layer's SDPA call takes it as it is),
  per-row M-RoPE positions, the cache's `update` writing each row at its own position, lm_head,
  banned tokens, sampling and per-row stop / max-token bookkeeping, all tensor ops: on CUDA it is
  captured once per (slot bucket, length bucket, sampling mode, plan) as a CUDA graph and replayed.
  A step reads nothing back.
- scheduler.py: every `sync_every` steps, and in a step that admitted a request (so that its first
  tokens are reported at once), the sync point: the host reads which rows are alive (and, streaming,
  copies the new tokens into the StepOutputs); finished rows leave (their results in the outputs,
  their slots freed), and with nobody waiting, running rows move down into freed slots when the
  step's bucket shrinks (compaction).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from collections import deque

import torch

from vlforge.generate.batch import Batch, BatchSettings, take_fitting
from vlforge.generate.cache import LENGTH_BUCKET, bucket
from vlforge.generate.plan import Plan, cuda_autocast, graphs_possible, kv_dtype, kv_dtypes
from vlforge.generate.requests import GenRequest, Outputs, GenResult, GenStats, StepOutput, check_request, \
    sampling_mode
from vlforge.generate.runner import MAX_STOP_IDS, Runner
from vlforge.generate.scheduler import Scheduler
from vlforge.model.tiers import unwrap


class Engine:
    """Generation for one model: its KV slots, decode state and CUDA graphs live across batches. Built by
    whoever owns the model (a GRPO run, an InferenceModel), with these settings:

    use_graphs: None = on CUDA, unless torch.distributed runs several processes (FSDP2's hooks
    must run every forward); False = eager steps (the same code; CPU always).
    compile: torch.compile the decode step's language-model forward (fuses the layers' small
    elementwise ops: norms, rotary, activations; a graph of the eager layers is ~65 kernels per layer
    and bound by their count) and, apart, its logits-to-token part (decode.pick: the passes over [S, V]):
    1.9x faster steps on an H200 (2B, 64 rows: 7.4 -> 3.8 ms) for a compile of ~80-95 s, once per
    engine (dynamic shapes: one compile serves every bucket of 2 slots or more; its time counts in
    capture_s). Worth it for a GRPO run, not for one eval pass. Default for open(compile=None).
    compact: at a sync point with nobody waiting, move running rows down into freed slots when that
    shrinks the step's slot bucket (Scheduler._compact); False keeps every row in its first slot.
    share_prompt: a generate call whose requests all have the same n >= 2 samples stores each
    prompt's KV once for its n rows (GroupCache) instead of a copy per row, so a decode step reads
    a prompt's KV once per group: less attention traffic (the prompt is most of a GRPO row's KV)
    and less KV memory; the same tokens (tested). False: SlotCache always.
    join_share: while rows run, waiting requests join only once this share of the batch's slots is
    free (or as many as wait: one waiting request joins the first free slot, so a lone request never
    waits for it), for at most scheduler.MAX_JOIN_HOLD sync points, so that one prefill serves several
    joins (a batch caller's throughput; a server's engine takes 0: a request joins at the next step).
    Measured on an H200 (2B, 256 requests of 16-512 tokens through 64 slots, joins at every sync
    point): 92 prefills of ~59 ms each took 5.4 s of the 11.3 s run, the decode steps 5.8 s
    (docs/benchmarks-log.md, 2026-12-02, "FSDP2 units at world size 1"). 0: join whenever a slot is free.
    max_prefill_tokens: the most prompt tokens of one prefill (one request at least: a longer prompt is
    prefilled alone). step_prefill_tokens: the same while rows decode (interleaved prefill): a burst of
    requests joining a running batch is prefilled over several steps, each followed by the running rows'
    decode step, so they stall for a few short prefills instead of one long one; a prompt longer than it
    is still prefilled whole in its step (prefill is not chunked within a prompt). None (a batch
    caller's default): max_prefill_tokens, one prefill as large as it may be (the most work per call);
    a server's engine takes a small one (infer.model.STEP_PREFILL_TOKENS: time to first token).
    fuse_projections: each decoder layer's q/k/v projections, and its MLP's gate/up, computed as one
    GEMM each in the prefill and the decode steps (generate/fused.py; weights that need no gradient
    only: inference models, frozen LoRA bases and GRPO's rollout copies). False: one GEMM per
    projection, as transformers.
    """

    def __init__(self, model, *, max_slots: int = 256, sync_every: int = 8, use_graphs: bool | None = None,
                 compile: bool = False, max_prefill_tokens: int = 32768, step_prefill_tokens: int | None = None,
                 compact: bool = True,
                 join_share: float = 0.125, share_prompt: bool = True, fuse_projections: bool = True):
        if not 0.0 <= join_share <= 1.0:
            raise ValueError(f"join_share: a share of the slots in [0, 1], got {join_share}")
        self.runner = Runner(unwrap(model))  # which holds the model by a weak reference
        self.max_slots, self.sync_every, self.use_graphs = max_slots, sync_every, use_graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.step_prefill_tokens = max_prefill_tokens if step_prefill_tokens is None else step_prefill_tokens
        self.compile, self.compact, self.join_share = compile, compact, join_share
        self.share_prompt, self.fuse_projections = share_prompt, fuse_projections
        self.plan: Plan | None = None  # what the last call decided (read by tests and benchmarks)
        self.stats = GenStats()  # the last call's (the pull API: the running or last batch's)
        self._pull: BatchSettings | None = None  # open()'s settings
        self._batch: Batch | None = None  # the pull API's running batch
        self._waiting: deque[tuple[int, GenRequest]] = deque()  # added, not yet in a batch
        self.outputs = Outputs()  # what the added requests produced, by id
        self._cancel: set[int] = set()
        self._passed: dict[int, int] = {}  # waiting id -> steps that requests added later joined past it
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
                 image_token_id: int, pad_id: int, slots: int | None = None, compile: bool | None = None,
                 record_routes: bool = False) -> list[GenResult]:
        """Results in request order (each request's n samples in turn, GenResult.request its position):
        open, add every request, step until all have finished. The arguments are open's; `slots` defaults
        to every sample at once (up to max_slots). The requests make one closed batch: with one n = G >= 2
        for all, each prompt's KV is shared by its G rows (Engine.share_prompt)."""
        if self._batch is not None or self._waiting:  # its buffers and slots are in use
            raise RuntimeError("generate: requests added with add() are still running (step() until they finish)")
        for i, r in enumerate(requests):
            check_request(i, r)
        if not requests:
            return []
        settings = self._pull
        self.open(stop_ids=stop_ids, banned_ids=banned_ids, image_token_id=image_token_id, pad_id=pad_id,
                  slots=min(slots or self.max_slots, sum(r.n for r in requests)), compile=compile,
                  record_routes=record_routes, share_prompt=self.share_prompt, stream=False)
        try:
            ids = [self.add(r) for r in requests]
            results: dict[int, tuple[GenResult, ...]] = {}
            while len(results) < len(ids):
                results.update((o.id, o.results) for o in self.step() if o.finished)
        except BaseException:
            self.clear()  # nothing of a failed call stays queued or running
            raise
        finally:
            self._pull = settings
        return [replace(res, request=i) for i, id in enumerate(ids) for res in results[id]]

    # -- the pull API: add requests, step the running batch, read its outputs ----------------------

    def open(self, *, stop_ids: list[int], banned_ids: list[int], image_token_id: int, pad_id: int,
             slots: int | None = None, compile: bool | None = None, record_routes: bool = False,
             share_prompt: bool = False, stream: bool = True) -> None:
        """The settings add/step run with; a change applies from the next batch (see step). stop_ids,
        banned_ids: never sampled; image_token_id, pad_id: the prompts'; `slots`: the most rows decoding
        at once (default max_slots); `compile`: the decode step compiled (default: the engine's; CUDA
        graphs only); `record_routes` (MoE): each result carries its tokens' experts (generate/routes.py).
        `share_prompt`: a batch whose requests, all added before its first step, have one n = G >= 2
        stores each prompt's KV once for its G rows (GroupCache; requests added later wait for the next
        batch). `stream`: steps report new tokens (one copy at each sync point); False: results only."""
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        if record_routes and self.runner.recorder is None:
            raise ValueError("record_routes: the model has no mixture-of-experts router to record")
        self._pull = BatchSettings(tuple(stop_ids), tuple(banned_ids), image_token_id, pad_id, slots, compile,
                                   record_routes, share_prompt, stream)

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
        self.outputs.added(id, request.n)
        return id

    def cancel(self, id: int) -> None:
        """End a request at the next step: its rows stop and free their slots before that step admits
        anyone; its output says cancelled (unknown or finished ids: nothing)."""
        if id in self.outputs.results:
            self._cancel.add(id)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One decode step of the running batch, then what it produced. In order: cancelled requests
        leave (their rows stop, their slots free now); waiting requests join the running batch while
        they fit it (with none running, a new batch starts, its Plan and buffers decided for the
        requests waiting then); those the free slots take are prefilled (first token sampled); one
        decode step; and every `sync_every` steps, or at once in a step that admitted someone, the sync
        point: the one host read (which rows are still alive, plus the copy of new tokens when
        streaming), where finished rows leave. The host knows which slots it freed, so a request
        added between steps decodes (and, streaming, reports its first tokens) in the next step."""
        cancelled = self._take_cancelled()
        self._join_waiting()
        if (b := self._batch) is None:
            return self.outputs.take(cancelled)
        sched, runner = b.sched, self.runner
        if ended := cancelled & (set(sched.queue) | {t for t, _ in sched.occupant.values()}):
            sched.finish(sched.finish_early(ended, runner), runner)
        if admitted := sched.admit(count_hold=b.since_sync == 0):
            b.mode = sampling_mode([r for _, r, _ in admitted], b.mode)
            self._prefill(admitted, b)
        if sched.occupant:
            self._decode_step(b)
            if b.since_sync >= self.sync_every or (admitted and b.settings.stream):
                self._sync(b)
        if not sched.busy:
            self._batch = None  # drained: the next request starts a batch of its own Plan
        return self.outputs.take(cancelled)

    def _take_cancelled(self) -> set[int]:
        """The ids cancelled since the last step; those still waiting (never in a batch) leave now."""
        cancelled, self._cancel = self._cancel, set()
        for id, r in [(i, r) for i, r in self._waiting if i in cancelled]:
            self._waiting.remove((id, r))
            self._passed.pop(id, None)
            self.outputs.unstarted(id)
        return cancelled

    def _join_waiting(self) -> None:
        if not self._waiting:
            return
        if self._batch is None:
            s = self._pull
            plan, sched = self._start(dict(self._waiting), s)
            self.runner.prepare(plan, s.stop_ids, s.banned_ids, s.pad_id, sched.prompt_span)
            # the mode every request waiting now needs, from the first step (GRPO's call: one set of graphs)
            self._batch = Batch(plan, sched, s, sampling_mode([r for _, r in self._waiting], "greedy"))
            self._waiting.clear()
            self._passed.clear()
        else:
            self._batch.sched.join(take_fitting(self._waiting, self._batch.sched.fits, self._passed))

    def clear(self) -> None:
        """Forget every added request, running or waiting, without results (after a step raised: the
        caller answers them); the next add starts a new batch."""
        self._batch, self._cancel, self._passed, self.outputs = None, set(), {}, Outputs()
        self._waiting.clear()

    def _start(self, requests: dict[int, GenRequest], s: BatchSettings) -> tuple[Plan, Scheduler]:
        """A batch's plan, its KV buffers (sized for the requests known now) and its scheduler."""
        device = self.core.lm_head.weight.device
        n_slots = bucket(min(s.slots or self.max_slots, self.max_slots))
        self.plan = plan = self._plan(requests, s, device)
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
                               self.outputs, stream=s.stream, join_share=self.join_share,
                               max_prefill_tokens=self.max_prefill_tokens,
                               step_prefill_tokens=self.step_prefill_tokens, compact=self.compact,
                               closed=bool(plan.group))

    def _plan(self, requests: dict[int, GenRequest], s: BatchSettings, device) -> Plan:
        graphs = self.graphs_on(device)
        sizes = {r.n for r in requests.values()}
        # before the weights' storage is read below: a first call makes the fused weights views of one buffer
        fusing = self.fuse_projections and self.runner.fuse()
        return Plan(
            # every request n = G >= 2 samples, all known now (GRPO, eval with n > 1): a GroupCache, each
            # prompt's KV read once per group
            group=min(sizes) if s.share_prompt and len(sizes) == 1 and min(sizes) >= 2 else 0,
            graphs=graphs, compiled=graphs and (s.compile if s.compile is not None else self.compile),
            fusing=fusing, recording=s.record_routes,
            weights=hash(tuple(p.data_ptr() for p in self.core.parameters())),
            mask_dtype=kv_dtype(self.runner.lm, device), training=self.core.training, autocast=cuda_autocast(),
            fp8=self.runner.fp8 is not None)

    def _prefill(self, admitted: list[tuple[int, GenRequest, list[int]]], b: Batch) -> None:
        start = time.perf_counter()
        self.runner.prefill(b.plan, admitted, b.settings.image_token_id, b.settings.pad_id, b.mode)
        b.sched.prefilled(admitted)
        self.stats.prefills += 1
        self.stats.prefill_s += _elapsed(start, self.runner.cache.rows.device)

    def _decode_step(self, b: Batch) -> None:
        """One decode step over the occupied slots (queued: no host read)."""
        S, Lb = b.sched.shape(1)
        start = time.perf_counter()
        self.runner.run_steps(b.plan, S, Lb, b.mode, 1, self.stats)
        b.sched.advance(1)
        b.since_sync += 1
        self.stats.row_steps += S
        self.stats.steps += 1
        self.stats.decode_s += time.perf_counter() - start

    def _sync(self, b: Batch) -> None:
        """The sync point: which rows are still alive (the host read that waits for the queued steps),
        their new tokens streamed, the finished ones out."""
        start, sched = time.perf_counter(), b.sched
        S = max(sched.occupant) + 1
        alive = self.runner.alive(S)
        if b.settings.stream:
            sched.stream(self.runner, S)
        sched.finish([slot for slot in sched.occupant if not alive[slot]], self.runner)
        b.since_sync = 0
        self.stats.decode_s += time.perf_counter() - start


def _elapsed(start: float, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
