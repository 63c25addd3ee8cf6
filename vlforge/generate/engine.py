"""The generation engine: prefill once, decode many steps from a preallocated KV cache, continuous batching.

    engine = engine_for(model)                       # one per model, kept with its buffers and graphs
    results = engine.generate([GenRequest(Prompt(ids, pixels, grid), n=8, max_new_tokens=256,
                                          temperature=1.0, seed=s)], stop_ids=encoder.end_ids,
                              banned_ids=vision_token_ids(encoder))

    feed = Feed(refill)                              # requests joining a running call (the server's)
    ticket = feed.put(GenRequest(...))               # from any thread; joins at the next sync point
    engine.generate([], ..., feed=feed, on_tokens=..., on_result=...)    # feed.finish(ticket) ends one

Shapes: S decode slots, L KV-cache length, Lb the filled part attention reads (a bucket), B
prompts of one prefill, V vocabulary, D head dim.

How a call runs (transformers' own Qwen3-VL layers throughout; nothing re-implemented but the
cache, the decode attention call and, in generate/fused.py, the q/k/v and gate/up projections of
a layer as one GEMM each):

- The scheduler keeps a queue of requests and a fixed set of slots. At each sync point, waiting
  requests (each: one prompt, n samples) are admitted while free slots remain; their images are
  encoded once, their prompts prefilled once (`forward_shared` with a DynamicCache, the model's
  own attention), and each prompt's KV is copied, left padding stripped, into its n slots of
  `SlotCache` ([slots, kv heads, L, D] per layer). A call whose requests all have n = G >= 2 (and no
  feed) uses `GroupCache` instead: each prompt's KV once for its G rows, their tokens interleaved
  after it, read once per group by the decode attention (`Engine(share_prompt=False)`: SlotCache).
  The first token is sampled from the prefill.
- A decode step is the language model on [S, 1] with a 4-D additive mask (0 / dtype min) built
  once a step on the GPU from the per-row lengths (masking_utils returns a 4-D mask as given, so
  every layer's SDPA call takes it as it is), per-row M-RoPE positions,
  `SlotCache.update` writing each row at its own position, lm_head, banned tokens, sampling
  (generate.sampling) and per-row stop / max-token bookkeeping, all tensor ops: on CUDA it is
  captured once per (slot bucket, length bucket, sampling mode) as a CUDA graph and replayed.
- The host syncs every `sync_every` steps: finished rows leave (their slots are freed, `on_result`
  is called), waiting requests join (also those put on a Feed meanwhile; a finished one's slot
  is freed). A row's tokens do not depend on which other rows share its
  steps (per-row positions and masks, per-row noise), so joining mid-batch changes nothing.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import warnings
import weakref
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from transformers import AttentionInterface

from vlforge.generate.forward import ImageFeatures, cache_of, encode_images, forward_shared, rope_positions
from vlforge.generate.fused import FusedProjections
from vlforge.generate.routes import NO_ROUTE, ROUTE_DTYPE, recorder_of, router_modules
from vlforge.generate.sampling import row_key, sample
from vlforge.model.host_inputs import host_to_device, joined_to_device
from vlforge.model.nf4 import expert_weight_dtype
from vlforge.model.quant import expert_modules
from vlforge.model.tiers import fsdp_sharded, unwrap

SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_BUFFER_ROWS = 4  # slots (GroupCache: groups) the KV buffers hold at least (Engine._ensure_buffers)
MAX_JOIN_HOLD = 4  # sync points waiting requests are held for a fuller prefill at most (Engine.join_share)
LENGTH_BUCKET = 128  # attention reads the cache up to the next multiple of this past the longest row
MAX_STOP_IDS = 8
# what a failed torch.compile of a decode step raises (graph breaks under fullgraph, guards that
# specialized a marked size, backend failures): errors of the model itself are none of these
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, ConstraintViolationError)
DECODE_ATTENTION = "vlforge_decode"  # the decode step's attention (SlotCache), registered below
GROUPED_ATTENTION = "vlforge_decode_grouped"  # GroupCache's (Engine(share_prompt=True))


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [P] token ids, no padding
    pixel_values: torch.Tensor | None = None  # the patch rows of its images
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    # images after those (their placeholders after theirs): a multi-turn conversation's tool images,
    # its own where `pixel_values` is its prompt's, shared with its other samples (each tensor is
    # encoded once per engine call, however many prompts hold it)
    own_pixel_values: torch.Tensor | None = None
    own_image_grid_thw: torch.Tensor | None = None

    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Its (pixel tensor, grid on the host) pairs, in its images' order."""
        return [(x, g.cpu()) for x, g in ((self.pixel_values, self.image_grid_thw),
                                          (self.own_pixel_values, self.own_image_grid_thw)) if g is not None and len(g)]

    @property
    def images(self) -> int:
        return sum(len(g) for _, g in self.pieces())


def prompts_of_batch(batch: dict, images_per_prompt: list[int]) -> list[Prompt]:
    """The prompts of a left-padded collated batch (input_ids, attention_mask, pixel_values,
    image_grid_thw), padding removed, each with its own images' patch rows, on the host (the
    engine builds its prefill there: one copy of each tensor here, not host reads per prompt)."""
    batch = {k: v.cpu() for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                           "image_grid_thw")}
    grid = batch.get("image_grid_thw")
    pixels = batch.get("pixel_values")
    bounds = [0, *torch.cumsum(grid.prod(-1), 0).tolist()] if grid is not None else [0]
    out, image = [], 0
    for b, n in enumerate(images_per_prompt):
        ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
        if n:
            out.append(Prompt(ids, pixels[bounds[image]:bounds[image + n]], grid[image:image + n]))
        else:
            out.append(Prompt(ids))
        image += n
    return out


@dataclass
class GenRequest:
    prompt: Prompt
    n: int = 1  # samples of this prompt (one prefill, n slots)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    first_row: int = 0  # sample i draws the noise of global row first_row + i
    min_new_tokens: int = 0  # stop ids are masked out of the logits before this many tokens (as generate's)


@dataclass
class GenResult:
    request: int  # index into the generate() list (with a feed: the request's ticket)
    sample: int  # 0..n-1
    tokens: torch.Tensor  # [R] generated ids (the stop token included when one ended it), CPU
    logprobs: torch.Tensor  # [R] fp32 log-probs of the temperature-scaled policy, CPU
    stopped: bool  # ended at a stop id (False: max_new_tokens)
    # generate(record_routes=True), MoE: [L, P + R - 1, k] int16 top-k expert ids of each MoE layer for the
    # prompt's tokens and every generated one the model read (all but the last), CPU (generate/routes.py)
    routes: torch.Tensor | None = None


@dataclass
class GenStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0  # CUDA-graph capture in this call (graphs are kept across calls)
    steps: int = 0  # decode steps run (graph replays or eager steps)
    row_steps: int = 0  # rows those steps computed (slot bucket x steps; finished rows in it count too)
    compactions: int = 0  # sync points that moved running rows into lower free slots (a smaller bucket)
    prefills: int = 0
    tokens: int = 0
    graphs: list = field(default_factory=list)  # keys of graphs captured in this call


class Feed:
    """Requests added to a running `generate(..., feed=feed)` from any thread; the scheduler takes
    them at its next sync point (they join the decode batch while slots are free) and ends the
    rows of requests `finish`ed. A fed request is known by the ticket `put` returns (its index in
    results and callbacks: with a feed, every request comes through it).

    A request whose prompt + max_new_tokens does not fit the call's KV length (or whose n exceeds
    its slots) stays queued while later requests that fit pass it, for at most `max_passed` sync
    points (so one long request does not hold up the short ones behind it, nor wait for ever);
    then taking stops, the running rows drain, the call returns and the next call sizes for it.
    A request `finish`ed while still queued is taken at once, fitting or not, and leaves with an
    empty result before any prefill. `refill`, if given, is called at every sync point before
    taking (a single-threaded caller's chance to put arrivals and finish requests).
    """

    def __init__(self, refill: Callable[["Feed"], None] | None = None, max_passed: int = 16):
        self._lock = threading.Lock()
        self._new: deque[tuple[int, GenRequest]] = deque()
        self._passed: dict[int, int] = {}  # ticket -> sync points it did not fit while later ones were taken
        self.max_passed = max_passed
        self._finish: set[int] = set()
        self._tickets = 0
        self.refill = refill

    def put(self, request: GenRequest) -> int:
        with self._lock:
            ticket, self._tickets = self._tickets, self._tickets + 1
            self._new.append((ticket, request))
        return ticket

    def finish(self, ticket: int) -> None:
        """End the request at the next sync point: its result holds the tokens generated so far
        (none if it had not started)."""
        with self._lock:
            self._finish.add(ticket)

    def pending(self) -> int:
        with self._lock:
            return len(self._new)

    def _take(self, fits: Callable[[GenRequest], bool]) -> list[tuple[int, GenRequest]]:
        """The queued requests that fit, in order; one that does not is passed over (and counted),
        until it has been passed `max_passed` times: from it on, nothing more is taken."""
        with self._lock:
            out, kept = [], deque()
            while self._new:
                ticket, request = self._new.popleft()
                if ticket in self._finish or fits(request):  # a finished one is never prefilled: it costs nothing
                    out.append((ticket, request))
                    continue
                kept.append((ticket, request))
                self._passed[ticket] = self._passed.get(ticket, 0) + 1
                if self._passed[ticket] > self.max_passed:  # its turn: let the running rows drain
                    # (a finished one behind it still leaves now: it costs nothing and its client is gone)
                    out.extend((t, r) for t, r in self._new if t in self._finish)
                    kept.extend((t, r) for t, r in self._new if t not in self._finish)
                    self._new.clear()
            self._new = kept
            for ticket, _ in out:
                self._passed.pop(ticket, None)
            return out

    def _finished(self) -> set[int]:
        """The finished tickets the call has taken (those still queued stay marked until taken)."""
        with self._lock:
            queued = {t for t, _ in self._new}
            done, self._finish = self._finish - queued, self._finish & queued
            return done


def _mask_for(mask, query):
    """The additive step mask in the query's dtype (the engine builds one additive mask in the usual
    dtype; a layer an override runs in fp32 casts it)."""
    return mask if mask is None or mask.dtype == query.dtype else mask.to(query.dtype)


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One query token per row: the query heads of a KV head attend as one group ([S, kv heads,
    q heads / kv heads, D]), so grouped-query attention reads the KV cache once instead of
    repeating it per query head (transformers' sdpa path repeats it when a mask is given)."""
    S, Hq, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1:
        raise RuntimeError("the decode attention takes one query token per row")
    out = F.scaled_dot_product_attention(query.reshape(S, Hkv, Hq // Hkv, D), key, value,
                                         attn_mask=_mask_for(attention_mask, query), scale=scaling)
    return out.reshape(S, Hq, 1, D).transpose(1, 2), None


def _decode_attention_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """GroupCache's decode attention: the G rows of a group (one prompt's samples) attend as G query
    tokens of one sequence whose keys are the prompt's (stored once) followed by the G rows' generated
    tokens interleaved; the [P, 1, G x q heads per kv head, Lk] mask lets each row see the prompt and
    its own tokens only. One SDPA call reads the prompt's KV once per group instead of once per row.
    query [P*G, q heads, 1, D], key/value [P, kv heads, Lk, D] -> [P*G, 1, q heads, D]."""
    S, Hq, q, D = query.shape
    P, Hkv = key.shape[:2]
    G = S // P
    if q != 1:
        raise RuntimeError("the decode attention takes one query token per row")
    q_PHQD = query.reshape(P, G, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(P, Hkv, G * (Hq // Hkv), D)
    out = F.scaled_dot_product_attention(q_PHQD, key, value, attn_mask=_mask_for(attention_mask, query), scale=scaling)
    return out.reshape(P, Hkv, G, Hq // Hkv, D).transpose(1, 2).reshape(S, 1, Hq, D), None


AttentionInterface.register(DECODE_ATTENTION, _decode_attention)
AttentionInterface.register(GROUPED_ATTENTION, _decode_attention_grouped)


class SlotCache:
    """The KV cache of the decode slots, passed to transformers' layers as `past_key_values`.

    keys/values: per layer [slots, kv heads, L, D], allocated once. Before each step, `bind` says
    how many slots the step runs (S), how far attention reads (Lb) and where each row writes
    (its own length: rows of different lengths share a step). transformers' attention calls
    `update(k, v, layer)` with the new token's [S, kv heads, 1, D] and attends to what it returns.
    """

    is_compileable = True  # static shapes: masking_utils never drops our mask for is_causal

    def __init__(self, layers: int, slots: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        # one spare position, never read: a [:S, :, :Lb] view is then never the whole buffer, so the
        # compiled step's Lb never meets a contiguity check that holds (which would specialize Lb on
        # the longest bucket and break _compiled_once's one compile)
        shape = (slots, kv_heads, length + 1, head_dim)
        dtypes = _per_layer(dtype, layers)  # a layer whose attention an override runs in fp32 keeps fp32 keys
        self.keys = [torch.zeros(shape, dtype=d, device=device) for d in dtypes]
        self.values = [torch.zeros(shape, dtype=d, device=device) for d in dtypes]
        self.rows = torch.arange(slots, device=device)
        self.slots, self.length, self.dtype = slots, length, dtypes
        self.write_S = self.span_L = None

    def bind(self, write_S: torch.Tensor, span_L: torch.Tensor) -> None:
        """Rows write at write_S ([S]); attention reads len(span_L) positions. Sizes come from
        tensors, not Python ints, so a compiled step serves every bucket without recompiling."""
        self.write_S, self.span_L = write_S, span_L

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        S, Lb = key_states.shape[0], self.span_L.shape[0]
        rows = self.rows[:S]
        K[rows, :, self.write_S] = key_states[:, :, 0].to(K.dtype)
        V[rows, :, self.write_S] = value_states[:, :, 0].to(V.dtype)
        return K[:S, :, :Lb], V[:S, :, :Lb]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # not used for positions: every call passes explicit position ids and a 4-D mask

    def fill(self, slots_M: torch.Tensor, cache, rows_M: torch.Tensor, lengths_M: torch.Tensor, P: int) -> None:
        """Copy prefill KV (a DynamicCache over B left-padded prompts of length P) into slots:
        slot m gets prompt rows_M[m]'s last lengths_M[m] positions, at 0.. (padding stripped)."""
        j = torch.arange(P, device=slots_M.device)
        src_MP = (P - lengths_M[:, None] + j[None]).clamp(max=P - 1)  # past a row's length: masked anyway
        for layer, (K, V) in enumerate(zip(self.keys, self.values)):
            k, v = _layer_kv(cache, layer)
            idx = src_MP[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            K[slots_M, :, :P] = k[rows_M].gather(2, idx).to(K.dtype)
            V[slots_M, :, :P] = v[rows_M].gather(2, idx).to(V.dtype)


class GroupCache(SlotCache):
    """The KV cache of a call whose requests all have n = G >= 2 samples (GRPO's groups): one prompt's
    KV stored once for its G rows, the rows' generated tokens interleaved after it.

    keys/values: per layer [groups, kv heads, L, D]. Group p holds the rows of slots p*G .. p*G+G-1
    (one request). Positions 0..prompt length-1: the prompt's KV (SlotCache.fill, slots = groups);
    from `prompt_span` (the call's longest prompt) on: generated token t of member i at
    prompt_span + t*G + i, so the filled part is one prefix of the buffer and one SDPA call per
    group reads the prompt once (_decode_attention_grouped) where SlotCache's rows read it G times.
    """

    def __init__(self, layers: int, groups: int, group: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        super().__init__(layers, groups, kv_heads, length, head_dim, dtype, device)
        self.group, self.groups = group, groups
        self.rows = torch.arange(groups * group, device=device)  # the slots (route recording indexes them)
        # slot s is member s % G of group s // G, whichever row it holds (compaction moves whole groups)
        self.group_of, self.member_of = self.rows // group, self.rows % group
        self.group_PG = self.write_PG = None

    def bind(self, group_PG: torch.Tensor, write_PG: torch.Tensor, span_L: torch.Tensor) -> None:
        """Row (p, i) writes into group group_PG[p, i] at write_PG[p, i]; attention reads len(span_L)
        positions of the first P groups ([P, G] views: the row count P*G derives from P)."""
        self.group_PG, self.write_PG, self.span_L = group_PG, write_PG, span_L

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        P, Lk = self.group_PG.shape[0], self.span_L.shape[0]
        group_S, write_S = self.group_PG.reshape(-1), self.write_PG.reshape(-1)
        K[group_S, :, write_S] = key_states[:, :, 0].to(K.dtype)
        V[group_S, :, write_S] = value_states[:, :, 0].to(V.dtype)
        return K[:P, :, :Lk], V[:P, :, :Lk]


def _per_layer(dtype, layers: int) -> tuple[torch.dtype, ...]:
    """A KV dtype per layer: `dtype` itself when it is one (a tuple), else `dtype` for every layer."""
    return tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype,) * layers


def _layer_kv(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # older DynamicCache


class _State:
    """Per-slot decode state on the device (every step reads and writes these in place)."""

    def __init__(self, slots: int, width: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tok = torch.zeros(slots, **long)  # the last sampled token: the next step's input
        self.pos = torch.zeros(slots, **long)  # its M-RoPE position (text positions after the prompt)
        self.length = torch.zeros(slots, **long)  # KV entries filled = where the input token is written
        self.count = torch.zeros(slots, **long)  # tokens generated
        self.max_new = torch.ones(slots, **long)
        self.min_new = torch.zeros(slots, **long)
        self.key = torch.zeros(slots, **long)  # noise key
        self.top_k = torch.zeros(slots, **long)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.prompt_len = torch.zeros(slots, **long)  # GroupCache: where the row's generated tokens start
        self.out_tok = torch.zeros(slots, width, **long)  # width > max_new_tokens: finished rows write past their end
        self.out_logp = torch.zeros(slots, width, dtype=torch.float32, device=device)

    def loop_vars(self):
        return [self.tok, self.pos, self.length, self.count, self.alive, self.stopped]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots src's state into slots dst (in place: captured graphs keep reading these tensors);
        the noise key and count travel along, so a moved row samples what it would have."""
        for t in vars(self).values():
            t[dst] = t[src]
        self.alive[src] = False


def _bucket(n: int, buckets=SLOT_BUCKETS) -> int:
    return next((b for b in buckets if b >= n), n)


@contextmanager
def _attention(config, name: str):
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def step_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decode step's attention mask from its boolean `keep`: additive (0 where read, the dtype's
    minimum elsewhere: finite, so a padding row that reads nothing gets finite garbage, not NaN).
    Built once a step where SDPA would convert a boolean mask in every layer. (An eager microbenchmark had the grouped attention ~2x faster with it; in the
    compiled, captured 2B step the two measured the same, 3.61 vs 3.62 ms on an H200: the
    benchmark's gap was launch cost. docs/benchmarks-log.md, 2026-12-03, "The additive step mask".)"""
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)


def _decode_hidden(core, cache, tok_S1, mask_S11L, pos_S):
    """The language model on one token per row: last hidden states [S, H]."""
    pos_31S = pos_S[None, :, None].expand(3, -1, -1)
    out = forward_shared(core, tok_S1, mask_S11L, pos_31S, None, [], cache=cache, use_cache=True)
    return out.last_hidden_state[:, -1]


def _decode_hidden_grouped(core, cache, tok_PG, mask_P1QL, pos_PG):
    """_decode_hidden over GroupCache's P groups of G rows ([P, G] inputs, the mask built by _step)."""
    pos_31S = pos_PG.reshape(-1)[None, :, None].expand(3, -1, -1)
    out = forward_shared(core, tok_PG.reshape(-1, 1), mask_P1QL, pos_31S, None, [], cache=cache, use_cache=True)
    return out.last_hidden_state[:, -1]


def _pick(logits_SV, banned_V, is_stop_V, early_S, temperature_S, top_k_S, top_p_S, key_S, step_S, mode: str):
    """(tokens, log-probs) of one step from lm_head's logits: fp32, banned ids and (rows still
    under their min_new_tokens: early_S) stop ids at -inf, then `sample`. A function of tensors
    only, so the engine can torch.compile it apart from the layers (one small graph per mode;
    it fuses the passes over the [S, V] logits)."""
    V = logits_SV.shape[-1]
    drop_SV = banned_V[None, :V] | (early_S[:, None] & is_stop_V[None, :V])
    x_SV = logits_SV.float().masked_fill(drop_SV, float("-inf"))
    return sample(x_SV, temperature_S, top_k_S, top_p_S, key_S, step_S, mode)


def _compiled_once(fn, varying: Callable[..., list[tuple[torch.Tensor, int]]]):
    """torch.compile(fn) that one compile serves every slot and length bucket and every KV buffer
    length: static shapes but for the (tensor, dimension) pairs `varying(*args)` names, marked
    dynamic at every call (the slot count S, the length bucket Lb, the buffers' length).

    Why not dynamic=True: it makes every dimension of every tensor dynamic, all four of each of the
    2 x layers KV buffers' too, and the symbolic-shape reasoning over those symbols (sympy) made the
    trace slow: a 2B GRPO run's first step was still tracing 190 s in on an H200 (stack samples),
    and on a CPU the 2B trace (bench/decode_trace_time.py) took 164 s, 28 s this way. The buffers'
    slot count stays static (a buffer of more slots compiles again: GRPO and serve keep one). Without
    duck sizing: by default dynamo takes sizes equal in the first call for one symbol, so S == Lb
    in a first call would guard `S == Lb` and compile again later. Size 1 is specialized whatever
    the setting (hence Engine's 2-slot floor for compiled steps); mark_dynamic fails loudly if the
    traced code specializes a marked size. The patch is process-wide while a call runs
    (ConfigModule.patch), which only matters to a compile running in another thread then.

    fullgraph: a graph break (a hook on the model that dynamo cannot trace, say) would split the step
    into pieces whose guards then specialized the marked sizes (a GRPO run died so in its first step
    on torch 2.11). A step that does not compile as one graph runs eager from then on, with a
    warning that says why: the run goes on at eager speed instead of stopping."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    failed: list[str] = []

    @functools.wraps(fn)
    def call(*args):
        if failed:
            return fn(*args)
        for tensor, dim in varying(*args):
            torch._dynamo.mark_dynamic(tensor, dim)
        try:
            with fx_config.patch(use_duck_shape=False):
                return compiled(*args)
        except COMPILE_ERRORS as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            failed.append(reason)
            warnings.warn(f"vlforge: the decode step ({fn.__name__}) did not compile as one graph and runs eager "
                          f"from now on ({type(error).__name__}: {reason}). Generation still works, at eager speed; "
                          "an uncompiled engine (GRPO: rollout.compile=false) does not try.", RuntimeWarning, stacklevel=2)
            return fn(*args)

    call.compile_failure = failed  # the reason, once a compile failed (for tests)
    return call


def _decode_varying(core, cache, tok_S1, mask_S11L, pos_S):
    varying = [(tok_S1, 0), (mask_S11L, 0), (mask_S11L, 3), (pos_S, 0), (cache.write_S, 0), (cache.span_L, 0),
               *((kv, 2) for kv in cache.keys + cache.values)]
    recorder = recorder_of(core)
    if recorder is not None and recorder.mode == "write":
        # MoE route recording: its hooks' [S] rows and [L, slots, length, k] routes
        varying += [(recorder.rows, 0), (recorder.routes, 2)]
    return varying


def _decode_grouped_varying(core, cache, tok_PG, mask_P1QL, pos_PG):
    # the group count P (every [P, G] input, the mask's and the bound views'), the read length Lk; G stays static
    varying = [(tok_PG, 0), (mask_P1QL, 0), (mask_P1QL, 3), (pos_PG, 0), (cache.group_PG, 0), (cache.write_PG, 0),
               (cache.span_L, 0), *((kv, 2) for kv in cache.keys + cache.values)]
    recorder = recorder_of(core)
    if recorder is not None and recorder.mode == "write":
        varying += [(recorder.rows, 0), (recorder.write, 0), (recorder.routes, 2)]
    return varying


def _pick_varying(logits_SV, banned_V, is_stop_V, *per_row_and_mode):
    return [(logits_SV, 0), *((t, 0) for t in per_row_and_mode[:-1])]  # the last one is the mode string


class Engine:
    """Generation for one model: its KV slots, decode state and CUDA graphs live across calls.

    use_graphs: None = on CUDA, unless torch.distributed runs several processes (FSDP2's hooks
    must run every forward); False = eager steps (the same code; CPU always).
    compile: torch.compile the decode step's language-model forward (fuses the layers' small
    elementwise ops: norms, rotary, activations; a graph of the eager layers is ~65 kernels per layer
    and bound by their count) and, apart, its logits-to-token part (_pick: the passes over [S, V]):
    1.9x faster steps on an H200 (2B, 64 rows: 7.4 -> 3.8 ms) for a compile of ~80-95 s, once per
    engine (dynamic shapes: one compile serves every bucket of 2 slots or more; its time counts in
    capture_s). Worth it for a GRPO run, not for one eval pass. Default for generate(compile=None).
    compact: at a sync point with nobody waiting, move running rows down into freed slots when that
    shrinks the step's slot bucket (_compact); False keeps every row in its first slot.
    share_prompt: a call whose requests all have the same n >= 2 samples (and no feed) stores each
    prompt's KV once for its n rows (GroupCache) instead of a copy per row, so a decode step reads
    a prompt's KV once per group: less attention traffic (the prompt is most of a GRPO row's KV)
    and less KV memory; the same tokens (tested). False: SlotCache always.
    join_share: while rows run, waiting requests join only once this share of the call's slots is
    free (or as many as wait: one waiting request joins the first free slot, so a lone request never
    waits for it), for at most MAX_JOIN_HOLD sync points, so that one prefill serves several joins.
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
        self._core = weakref.ref(unwrap(model))  # the engine lives as long as its model, not longer
        self.lm = self.core.model.language_model
        self.text_config = self.lm.layers[0].self_attn.config
        self.max_slots, self.sync_every, self.use_graphs = max_slots, sync_every, use_graphs
        self.max_prefill_tokens = max_prefill_tokens
        self.compile = compile
        self.compact = compact  # move running rows down into freed slots when the bucket would shrink
        if not 0.0 <= join_share <= 1.0:
            raise ValueError(f"join_share: a share of the slots in [0, 1], got {join_share}")
        self.join_share = join_share
        self.share_prompt = share_prompt
        self.fuse_projections = fuse_projections
        self._fused: FusedProjections | None = None  # the model's fusable groups (built at the first call)
        self._fusing = False  # this call's forwards run the fused projections (part of the graph key)
        self._mask_dtype = torch.float32  # this call's step mask dtype (the usual KV dtype)
        self._group = 0  # this call's GroupCache group size G (0: SlotCache)
        self._compiled = self._compiled_pick = self._compiled_grouped = None
        # what _step calls: eager or compiled, set per call
        self._decode_hidden, self._decode_hidden_grouped, self._pick = _decode_hidden, _decode_hidden_grouped, _pick
        self.cache: SlotCache | None = None
        self._largest: dict[int, tuple[int, int]] = {}  # buffer kind (GroupCache's G, 0) -> the largest (slots, length)
        self.state: _State | None = None
        self.graphs: dict = {}
        self.pool = None
        self.capture_s_total = 0.0
        self.stats = GenStats()
        # MoE: the routers' hooks, registered now, before the decode step is first compiled (routes.py: why)
        self.recorder = recorder_of(self.core)
        self.routes: torch.Tensor | None = None  # [L, slots, length, k] expert ids, when recording
        self._recording = False  # this call records routes (part of the graph key)
        self._step_compiled = False  # this call's decode step is the compiled one
        self._weights = 0  # which weight tensors this call's steps read (generate sets it)

    @property
    def core(self):
        return self._core()

    @property
    def _pixel_dtype(self) -> torch.dtype | None:
        """The dtype Qwen3-VL's patch embedding casts pixels to (its conv weight's), None for another tower."""
        weight = getattr(getattr(getattr(self.core.model.visual, "patch_embed", None), "proj", None), "weight", None)
        return weight.dtype if weight is not None and weight.dtype.is_floating_point else None

    @property
    def compile_failure(self) -> str | None:
        """Why the compiled decode step runs eager (its compile failed: _compiled_once); None if it
        compiled or was never tried."""
        for fn in (self._compiled, self._compiled_grouped, self._compiled_pick):
            if fn is not None and fn.compile_failure:
                return fn.compile_failure[0]
        return None

    def release(self) -> None:
        """Free the KV slots and graphs (e.g. before a memory-hungry phase); the next call
        allocates and captures again (the compiled step is kept)."""
        self.cache = self.state = self.routes = None
        self.graphs.clear()
        self.pool = None

    def reserve(self, slots: int, length: int, dtype: torch.dtype | None = None, group: int = 0) -> None:
        """Allocate the KV slots for `slots` rows of `length` positions now, so later calls up to that
        size reuse the same buffers and graphs (a larger call reallocates and recaptures). With
        `group` G: a GroupCache for calls of n = G samples a request (length: the longest prompt +
        G x max_new_tokens); one kind of buffer is held at a time, each kind's largest size is kept
        for when a call switches back (a compiled step compiles again for a new slot count)."""
        device = self.core.lm_head.weight.device
        slots = max(slots, 2 * max(group, 1) if self.compile else 1)  # compiled steps run at least 2 slots (groups)
        rows = group * _bucket(math.ceil(slots / group)) if group else _bucket(slots)
        self._ensure_buffers(rows, LENGTH_BUCKET * math.ceil(length / LENGTH_BUCKET),
                             dtype or self._kv_dtypes(device), device, group=group)

    # -- buffers ------------------------------------------------------------------------------

    def _ensure_buffers(self, slots: int, length: int, dtype, device, group: int = 0) -> None:
        """KV buffers of at least `slots` rows x `length` positions: a SlotCache, or with group G a
        GroupCache of slots / G groups (reused while large enough and of the same kind and G)."""
        c = self.cache
        kind = getattr(c, "group", 0)
        dtype = _per_layer(dtype, self.text_config.num_hidden_layers)
        if c is not None and c.slots * max(kind, 1) >= slots and c.length >= length and c.dtype == dtype and \
                c.keys[0].device == device and kind == group:
            return
        cfg = self.text_config
        # grown, never shrunk, per kind (SlotCache, GroupCache of G): a slot count seen before needs no new compile
        high_slots, high_length = self._largest.get(group, (0, 0))
        slots, length = max(slots, high_slots), max(length, high_length)
        self._largest[group] = (slots, length)
        self.cache = self.state = self.routes = None
        self.graphs.clear()  # they point at the old buffers
        self.pool = None  # a pool whose graphs are gone cannot take new captures
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # at least 4 slots (groups): in buffers of 2, the compiled step's [:S] views bound S to [2, 2],
        # which dynamo refines to the constant 2 (a marked size specialized: the compile fails)
        slots = max(slots, MIN_BUFFER_ROWS * max(group, 1))
        if group:
            self.cache = GroupCache(cfg.num_hidden_layers, slots // group, group, cfg.num_key_value_heads, length,
                                    head_dim, dtype, device)
        else:
            self.cache = SlotCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, length, head_dim, dtype,
                                   device)
        self.state = _State(slots, length + 1, device)
        self.prompt_span = torch.zeros((), dtype=torch.long, device=device)  # GroupCache: where generated tokens start
        self.arange_L = torch.arange(length, device=device)
        self.stop_ids = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)  # what finished rows emit
        self.banned = torch.zeros(self.core.lm_head.out_features, dtype=torch.bool, device=device)
        self.is_stop = torch.zeros_like(self.banned)  # the stop ids as a mask (min_new_tokens)

    def _graphs_on(self, device) -> bool:
        if device.type != "cuda":
            return False
        if self.use_graphs is not None:
            return self.use_graphs
        text_config = getattr(self.core.config, "text_config", self.core.config)
        if router_modules(self.core):
            impl = getattr(text_config, "_experts_implementation", None)
            if impl in (None, "eager"):
                # transformers' reference loop over experts asks the host which experts got tokens (a
                # sync per layer): a CUDA graph cannot capture it (grouped_mm / batched_mm can)
                return False
            # NF4 experts (bitsandbytes' parametrization, the routed path at few rows) decode under capture
            # as eagerly (tests/test_moe_quant.py's gpu probe, passed on an H100 on 2026-12-05)
            experts = list(expert_modules(self.core).values())
            if impl == "grouped_mm" and experts and expert_weight_dtype(experts[0], "gate_up_proj") != torch.bfloat16:
                # torch's grouped GEMM kernel is bf16; other dtypes take its fallback, which copies the
                # group offsets to the host (capture fails: measured on the H200 with fp32 weights)
                return False
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return False
        return not fsdp_sharded(self.core)  # FSDP2, even on one process: its hooks must run on every forward

    # -- one decode step (the captured part) -----------------------------------------------------

    def _step(self, S: int, Lb: int, mode: str) -> None:
        st = self.state
        length_S, alive_S = st.length[:S], st.alive[:S]
        span_L = self.arange_L[:Lb]
        # recording: each row's experts go where its input token's KV goes (length_S, updated by the step)
        routes = self.recorder.write_to(self.routes, self.cache.rows[:S], length_S) if self._recording \
            else nullcontext()
        if self._group:  # GroupCache: the mask and write positions of a group's interleaved layout
            G = self._group
            P, qpk = S // G, self.text_config.num_attention_heads // self.text_config.num_key_value_heads
            suffix_S = length_S - st.prompt_len[:S]  # the input token's index among the row's generated ones
            # a stale row past the call's layout (a padding group's) writes into the spare position, never read
            member_S = self.cache.member_of[:S]
            write_S = (self.prompt_span + suffix_S * G + member_S).clamp(max=self.cache.length)
            self.cache.bind(self.cache.group_of[:S].view(P, G), write_S.view(P, G), span_L)
            off_L = span_L - self.prompt_span
            keep_SL = (span_L[None] < st.prompt_len[:S, None]) | (
                (off_L[None] >= 0) & (off_L[None] % G == member_S[:, None]) & (off_L[None] // G <= suffix_S[:, None]))
            mask_P1QL = step_mask(keep_SL.view(P, G, 1, Lb).expand(P, G, qpk, Lb).reshape(P, 1, G * qpk, Lb),
                                  self._mask_dtype)
            with _attention(self.text_config, GROUPED_ATTENTION), routes, self._fusion():
                hidden_SH = self._decode_hidden_grouped(self.core, self.cache, st.tok[:S].view(P, G), mask_P1QL,
                                                        st.pos[:S].view(P, G))
        else:
            self.cache.bind(length_S, span_L)
            mask_S11L = step_mask((span_L[None] <= length_S[:, None])[:, None, None, :], self._mask_dtype)  # own slot too
            with _attention(self.text_config, DECODE_ATTENTION), routes, self._fusion():
                hidden_SH = self._decode_hidden(self.core, self.cache, st.tok[:S, None], mask_S11L, st.pos[:S])
        tok_S, logp_S = self._pick(self.core.lm_head(hidden_SH), self.banned, self.is_stop, st.count[:S] < st.min_new[:S],
                                   st.temperature[:S], st.top_k[:S], st.top_p[:S], st.key[:S], st.count[:S], mode)
        tok_S = torch.where(alive_S, tok_S, self.pad)
        col_S1 = st.count[:S, None]
        st.out_tok[:S].scatter_(1, col_S1, tok_S[:, None])
        st.out_logp[:S].scatter_(1, col_S1, torch.where(alive_S, logp_S, 0.0)[:, None])
        step_S = alive_S.long()
        st.count[:S] += step_S
        st.length[:S] += step_S
        st.pos[:S] += step_S
        stop_S = (tok_S[:, None] == self.stop_ids[None]).any(-1) & alive_S
        st.stopped[:S] |= stop_S
        st.alive[:S] = alive_S & ~stop_S & (st.count[:S] < st.max_new[:S])
        st.tok[:S] = tok_S

    def _fusion(self):
        """The fused projections for the forwards inside, when this call uses them."""
        return self._fused.installed() if self._fusing else nullcontext()

    def _graph_key(self, S, Lb, mode):
        autocast = torch.is_autocast_enabled("cuda")
        return (S, Lb, mode, self.core.training, autocast, torch.get_autocast_dtype("cuda") if autocast else None,
                self._step_compiled, self._recording, self._weights, self._group, self._fusing)

    def _run_steps(self, S: int, Lb: int, mode: str, steps: int, use_graphs: bool) -> None:
        if not use_graphs:
            for _ in range(steps):
                self._step(S, Lb, mode)
            return
        key = self._graph_key(S, Lb, mode)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(S, Lb, mode, key)
        for _ in range(steps):
            graph.replay()

    def _capture(self, S: int, Lb: int, mode: str, key) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = [t.clone() for t in self.state.loop_vars()]
        autocast = key[4]
        # autocast's weight-cast cache must stay off while capturing (a cached cast made outside
        # the graph would be freed under it)
        ctx = (torch.autocast("cuda", dtype=key[5], cache_enabled=False) if autocast
               else torch.autocast("cuda", enabled=False))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), ctx:
            self._step(S, Lb, mode)  # warm-up (cuBLAS handles, workspaces) before capture
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.state.loop_vars(), saved):
            t.copy_(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), ctx:
            self._step(S, Lb, mode)
        torch.cuda.synchronize()
        self.graphs[key] = graph
        seconds = time.perf_counter() - start
        self.capture_s_total += seconds
        self.stats.capture_s += seconds
        self.stats.graphs.append(key[:3])
        return graph

    # -- prefill ------------------------------------------------------------------------------

    def _prefill(self, admitted: list[tuple[int, GenRequest, list[int]]], image_token_id: int, pad_id: int,
                 mode: str) -> None:
        """Prefill the admitted requests' prompts in one batch and set up their slots."""
        device = self.cache.rows.device
        prompts = [r.prompt for _, r, _ in admitted]
        # the batch is built on the host and queued to the device: every host read of a device tensor
        # (and every blocking copy to it) would stall the CPU until the GPU's queue drains
        P = max(len(p.input_ids) for p in prompts)
        ids_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
        mask_BP = torch.zeros_like(ids_BP)
        for b, p in enumerate(prompts):
            ids_BP[b, P - len(p.input_ids):] = p.input_ids.cpu()
            mask_BP[b, P - len(p.input_ids):] = 1
        grids = [g for p in prompts for _, g in p.pieces()]
        grid = torch.cat(grids) if grids else None
        pos_3BP = rope_positions(self.core, ids_BP, mask_BP, image_token_id, grid)  # on the host
        next_pos_B = pos_3BP.amax(dim=(0, 2)) + 1
        ids_BP, mask_BP, pos_3BP = (host_to_device(t, device) for t in (ids_BP, mask_BP, pos_3BP))
        feats = self._image_features(prompts, device)
        with self.recorder.keep() if self._recording else nullcontext({}) as kept, self._fusion():
            out = forward_shared(self.core, ids_BP, mask_BP, pos_3BP, feats, list(range(len(prompts))), use_cache=True)
        slots, rows, keys, reqs = [], [], [], []
        for b, (_, r, sl) in enumerate(admitted):
            slots += sl
            rows += [b] * len(sl)
            keys += [row_key(r.seed, r.first_row + i) for i in range(len(sl))]
            reqs += [r] * len(sl)
        slots_M, rows_M = _queued(device, slots), _queued(device, rows)
        lengths_B = _queued(device, [len(p.input_ids) for p in prompts])
        G = self._group
        if G:  # one copy of each prompt's KV, into its request's group
            if any(sl != list(range(sl[0], sl[0] + G)) or sl[0] % G for _, _, sl in admitted):
                raise RuntimeError("GroupCache: a request's samples must take one whole group")
            groups_B = _queued(device, [sl[0] // G for _, _, sl in admitted])
            self.cache.fill(groups_B, cache_of(out), torch.arange(len(prompts), device=device), lengths_B, P)
        else:
            self.cache.fill(slots_M, cache_of(out), rows_M, lengths_B[rows_M], P)
        if self._recording:
            self._fill_routes(slots_M, kept, rows_M, lengths_B[rows_M], P)

        st = self.state
        st.temperature[slots_M] = _queued(device, [float(r.temperature) for r in reqs])
        st.top_p[slots_M] = _queued(device, [float(r.top_p) for r in reqs])
        st.top_k[slots_M] = _queued(device, [int(r.top_k) for r in reqs])
        st.key[slots_M] = _queued(device, keys)
        st.max_new[slots_M] = _queued(device, [r.max_new_tokens for r in reqs])
        st.min_new[slots_M] = _queued(device, [r.min_new_tokens for r in reqs])
        st.count[slots_M] = 0
        st.prompt_len[slots_M] = lengths_B[rows_M]
        # lm_head over the slots' rows (not the B prompts'): each row of every lm_head call is one
        # sequence, as in the decode steps
        tok_M, logp_M = _pick(self.core.lm_head(out.last_hidden_state[:, -1][rows_M]), self.banned, self.is_stop,
                              st.min_new[slots_M] > 0, st.temperature[slots_M], st.top_k[slots_M], st.top_p[slots_M],
                              st.key[slots_M], st.count[slots_M], mode)
        st.out_tok[slots_M, 0] = tok_M
        st.out_logp[slots_M, 0] = logp_M
        stop_M = (tok_M[:, None] == self.stop_ids[None]).any(-1)
        st.tok[slots_M] = tok_M
        st.count[slots_M] = 1
        st.length[slots_M] = lengths_B[rows_M]
        st.pos[slots_M] = host_to_device(next_pos_B, device)[rows_M]
        st.stopped[slots_M] = stop_M
        st.alive[slots_M] = ~stop_M & (st.max_new[slots_M] > 1)

    def _fill_routes(self, slots_M: torch.Tensor, kept: dict, rows_M: torch.Tensor, lengths_M: torch.Tensor,
                     P: int) -> None:
        """The prefill's expert ids (per layer [B*P, k] over the left-padded prompts) into the slots'
        positions 0.., padding stripped, as SlotCache.fill copies the KV; every other position of
        those slots is NO_ROUTE until a decode step writes it (so _harvest sees one it did not)."""
        L, k = self.routes.shape[0], self.routes.shape[-1]
        if len(kept) != L:
            raise RuntimeError(f"route recording: the prefill ran {len(kept)} of the {L} MoE routers")
        kept_LBPk = torch.stack([kept[p].view(-1, P, k) for p in range(L)])
        j = torch.arange(P, device=slots_M.device)
        src_MP = (P - lengths_M[:, None] + j[None]).clamp(max=P - 1)
        got_LMPk = kept_LBPk[:, rows_M].gather(2, src_MP[None, :, :, None].expand(L, -1, -1, k))
        got_LMPk = got_LMPk.masked_fill((j[None] >= lengths_M[:, None])[None, :, :, None], NO_ROUTE)
        self.routes[:, slots_M] = NO_ROUTE
        self.routes[:, slots_M, :P] = got_LMPk.to(self.routes.dtype)

    # -- the scheduler ------------------------------------------------------------------------

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
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}")
        if feed is not None and feed.refill is not None:
            feed.refill(feed)
        taken = feed._take(lambda r: True) if feed is not None else list(enumerate(requests))
        if not taken:
            return []
        for t, r in taken:
            _check(t, r)
        # by ticket (without a feed: the position in `requests`). A fed call may run as long as requests
        # come: a request leaves `requests` once prefilled, and `results` holds nothing unless returned
        requests: dict[int, GenRequest] = dict(taken)
        keep = feed is None or on_result is None  # the results are returned
        device = self.core.lm_head.weight.device
        total = sum(r.n for r in requests.values())
        n_slots = _bucket(min(slots or self.max_slots, self.max_slots, total if feed is None else self.max_slots))
        if max(r.n for r in requests.values()) > n_slots:
            raise ValueError(f"a request asks for {max(r.n for r in requests.values())} samples; the engine has "
                             f"{n_slots} slots (raise slots / max_slots)")
        kv_dtype = self._kv_dtypes(device)
        # the additive step mask in the usual KV dtype (a layer computing in another casts it: _decode_attention)
        self._mask_dtype = self._kv_dtype(device)
        use_graphs = self._graphs_on(device)
        compiled = use_graphs and (compile if compile is not None else self.compile)
        # torch.compile specializes a dimension of size 1 (dynamic=True or not): a one-row step would
        # compile the language model again (~2 min at 2B), so a compiled step runs at least 2 slots
        self._step_compiled = compiled
        if self.fuse_projections and self._fused is None:
            self._fused = FusedProjections(self.core)
        # before the weights' storage is read below: a first call makes the fused weights views of one buffer
        self._fusing = self.fuse_projections and self._fused.prepare() > 0
        # the weights' storage is part of a graph's key: a graph captured over other tensors (GRPO's
        # rollout reads bf16 copies of fp32 masters, PrecisionPolicy.inference_weights) is not replayed
        self._weights = hash(tuple(p.data_ptr() for p in self.core.parameters()))
        sizes = {r.n for r in requests.values()}
        # every request n = G >= 2 samples, all known now (GRPO, eval with n > 1): a GroupCache, each
        # prompt's KV read once per group
        self._group = G = sizes.pop() if (self.share_prompt and feed is None and len(sizes) == 1
                                          and min(sizes) >= 2) else 0
        prompt_span = max(len(r.prompt.input_ids) for r in requests.values())
        if G:
            groups = n_slots // G  # the call's groups; a step runs a bucket of them (a compiled one at least 2)
            need = prompt_span + G * max(r.max_new_tokens for r in requests.values())
            self._ensure_buffers(G * self._step_groups(groups), LENGTH_BUCKET * math.ceil(need / LENGTH_BUCKET),
                                 kv_dtype, device, group=G)
            self.prompt_span.fill_(prompt_span)
            self._prompt_span = prompt_span
        else:
            need = max(len(r.prompt.input_ids) + r.max_new_tokens for r in requests.values())
            self._ensure_buffers(max(n_slots, self._step_slots(1)), LENGTH_BUCKET * math.ceil(need / LENGTH_BUCKET),
                                 kv_dtype, device)
        if record_routes and self.recorder is None:
            raise ValueError("record_routes: the model has no mixture-of-experts router to record")
        self._recording = bool(record_routes)
        if self._recording and self.routes is None:  # with the slots: a new cache drops it (and the graphs)
            self.routes = torch.full((len(self.recorder.layers), len(self.cache.rows), self.cache.length,
                                      self.recorder.top_k), NO_ROUTE, dtype=ROUTE_DTYPE, device=device)
        self.stop_ids.fill_(-1)
        self.stop_ids[:len(stop_ids)] = _queued(device, stop_ids)
        self.is_stop.zero_()
        if stop_ids:
            self.is_stop[_queued(device, stop_ids)] = True
        self.pad.fill_(pad_id)
        self.banned.zero_()
        if banned_ids:
            self.banned[_queued(device, banned_ids)] = True
        self.state.alive.zero_()
        if compiled and self._compiled is None:
            self._compiled = _compiled_once(_decode_hidden, _decode_varying)
            self._compiled_grouped = _compiled_once(_decode_hidden_grouped, _decode_grouped_varying)
            self._compiled_pick = _compiled_once(_pick, _pick_varying)
        self._decode_hidden = self._compiled if compiled else _decode_hidden
        self._decode_hidden_grouped = self._compiled_grouped if compiled else _decode_hidden_grouped
        self._pick = self._compiled_pick if compiled else _pick
        mode = _mode(list(requests.values()), "greedy")

        self.stats = GenStats()
        results: dict[int, list[GenResult | None]] = {t: [None] * r.n for t, r in requests.items()} if keep else {}
        queue = deque(requests)
        free = list(range(G * (n_slots // G) if G else n_slots))  # GroupCache: whole groups only
        ended_in_group: dict[int, int] = {}  # GroupCache: group -> rows finished (its slots free with the last)
        occupant: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)
        sent: dict[int, int] = {}  # slot -> tokens already streamed
        bound: dict[int, int] = {}  # slot -> an upper bound of its KV length (host-side, no sync)
        prompt_len: dict[int, int] = {}  # slot -> its prompt's length

        def answered(res: GenResult) -> None:
            if keep:
                results[res.request][res.sample] = res
            if on_result is not None:
                on_result(res)

        if feed is not None and (ended := feed._finished()):  # finished while queued: no prefill
            self._finish_early(ended, occupant, [], queue, requests, answered)

        def fits(r: GenRequest) -> bool:  # joins this call: within its KV length and slots
            return len(r.prompt.input_ids) + r.max_new_tokens <= self.cache.length and r.n <= n_slots

        join_at = max(1, int(n_slots * self.join_share))  # free slots that make a prefill worth it while rows run
        held = 0  # sync points the waiting requests have been held for
        while queue or occupant:
            admitted, tokens = [], 0
            # joins wait for join_at free slots (or as many as all the waiting samples need), for at most
            # MAX_JOIN_HOLD sync points: slots free only as rows end, which long rows may not for a long time
            can_join = bool(queue) and requests[queue[0]].n <= len(free)
            hold = (can_join and bool(occupant) and held < MAX_JOIN_HOLD
                    and len(free) < min(join_at, sum(requests[q].n for q in queue)))
            held = held + 1 if hold else 0
            while queue and not hold and requests[queue[0]].n <= len(free):
                r = requests[queue[0]]
                if admitted and tokens + len(r.prompt.input_ids) > self.max_prefill_tokens:
                    break
                i = queue.popleft()
                free.sort()
                sl, free = free[:r.n], free[r.n:]
                admitted.append((i, r, sl))
                tokens += len(r.prompt.input_ids)
                for s, slot in enumerate(sl):
                    occupant[slot] = (i, s)
                    bound[slot] = prompt_len[slot] = len(r.prompt.input_ids)
                    sent[slot] = 0
            if admitted:
                mode = _mode([r for _, r, _ in admitted], mode)  # a joining request may need more than greedy
                start = time.perf_counter()
                self._prefill(admitted, image_token_id, pad_id, mode)
                if feed is not None:  # a fed call may run as long as requests come: hold no prefilled prompt (images)
                    for i, _, _ in admitted:
                        del requests[i]
                    admitted = r = taken = None  # nor any other name here
                self.stats.prefills += 1
                self.stats.prefill_s += _elapsed(start, device)
            if occupant:
                steps = self.sync_every
                if G:  # the rows' generated tokens, G to a position step, after the call's prompt span
                    S = G * self._step_groups(max(occupant) // G + 1)
                    suffix = max(bound[s] - prompt_len[s] for s in occupant)
                    span = LENGTH_BUCKET * max(1, G // 2)  # ~LENGTH_BUCKET / 2 positions a row at most unread
                    Lb = min(self.cache.length, span * math.ceil((prompt_span + G * (suffix + steps)) / span))
                else:
                    S = self._step_slots(max(occupant) + 1)
                    Lb = min(self.cache.length, LENGTH_BUCKET * math.ceil((max(bound.values()) + steps) / LENGTH_BUCKET))
                start = time.perf_counter()
                self._run_steps(S, Lb, mode, steps, use_graphs)
                self.stats.row_steps += S * steps
                for slot in occupant:
                    bound[slot] += steps
                alive = self.state.alive[:S].cpu()  # the sync point
                self.stats.decode_s += time.perf_counter() - start
                self.stats.steps += steps
                if on_tokens is not None:
                    self._stream(occupant, sent, S, on_tokens)
                done = [slot for slot in occupant if not alive[slot]]
            else:
                done = []
            if feed is not None:
                if feed.refill is not None:
                    feed.refill(feed)
                for t, r in feed._take(fits):  # before the finishes: one finished while queued leaves unprefilled
                    _check(t, r)
                    requests[t] = r
                    if keep:
                        results[t] = [None] * r.n
                    queue.append(t)
                if ended := feed._finished():
                    done = self._finish_early(ended, occupant, done, queue, requests, answered)
            if done:
                self._harvest(done, occupant, answered)
                for slot in done:
                    del occupant[slot], bound[slot], prompt_len[slot]
                if G:  # a group's slots free together, with its last row (a joining request takes a whole group)
                    for slot in done:
                        ended_in_group[slot // G] = ended_in_group.get(slot // G, 0) + 1
                        if ended_in_group[slot // G] == G:
                            free += range(slot // G * G, slot // G * G + G)
                            del ended_in_group[slot // G]
                    if self.compact and not queue:
                        self._compact_groups(occupant, bound, sent, prompt_len, free, ended_in_group)
                else:
                    free += done
                    if self.compact and not queue:
                        self._compact(occupant, bound, sent, prompt_len, free)
        return [res for per in results.values() for res in per]

    def _compact(self, occupant: dict, bound: dict, sent: dict, prompt_len: dict, free: list[int]) -> None:
        """Move running rows from slots at or past len(occupant) into the free slots below it, when
        that makes the step's slot bucket smaller: a step computes every slot up to the highest
        occupied one, so without this a batch's long tail (the last rows of a mixed-length GRPO
        group, a long serve request) runs at the bucket its first step had. Costs one copy of the
        moved rows' filled KV (every layer) and their state. The rows' tokens are unchanged (tested in
        fp32); in bf16 a smaller batch may run other GEMM kernels, whose rounding can change later
        tokens, as any change of batch size can."""
        n = len(occupant)
        if not n or self._step_slots(max(occupant) + 1) <= self._step_slots(n):
            return
        movers = sorted(s for s in occupant if s >= n)
        holes = sorted(s for s in range(n) if s not in occupant)[:len(movers)]
        device = self.state.tok.device
        src, dst = _queued(device, movers), _queued(device, holes)
        filled = min(self.cache.length, max(bound[s] for s in movers))  # KV past it is never read
        for K, V in zip(self.cache.keys, self.cache.values):
            K[dst, :, :filled] = K[src, :, :filled]
            V[dst, :, :filled] = V[src, :, :filled]
        if self._recording:  # past `filled` NO_ROUTE, so _harvest_routes still sees a step that did not record
            self.routes[:, dst] = NO_ROUTE
            self.routes[:, dst, :filled] = self.routes[:, src, :filled]
        self.state.move(src, dst)
        for s, d in zip(movers, holes):
            occupant[d], bound[d], sent[d], prompt_len[d] = occupant.pop(s), bound.pop(s), sent.pop(s), prompt_len.pop(s)
        free[:] = sorted((set(free) - set(holes)) | set(movers))
        self.stats.compactions += 1

    def _compact_groups(self, occupant: dict, bound: dict, sent: dict, prompt_len: dict, free: list[int],
                        ended_in_group: dict) -> None:
        """_compact for a GroupCache: whole groups (their prompt's KV and their rows' tokens) move into
        free groups below, when that makes the step's group bucket smaller."""
        G = self._group
        live = sorted({slot // G for slot in occupant})
        n = len(live)
        if not n or self._step_groups(live[-1] + 1) <= self._step_groups(n):
            return
        movers = [g for g in live if g >= n]
        holes = [g for g in range(n) if g not in live][:len(movers)]
        device = self.state.tok.device
        src, dst = _queued(device, movers), _queued(device, holes)
        suffix = max(bound[s] - prompt_len[s] for s in occupant if s // G in movers)
        filled = min(self.cache.length + 1, self._prompt_span + G * (suffix + 1))  # past it nothing was written
        for K, V in zip(self.cache.keys, self.cache.values):
            K[dst, :, :filled] = K[src, :, :filled]
            V[dst, :, :filled] = V[src, :, :filled]
        rows = [(g * G + i, h * G + i) for g, h in zip(movers, holes) for i in range(G)]
        src_rows = _queued(device, [a for a, _ in rows])
        dst_rows = _queued(device, [b for _, b in rows])
        if self._recording:
            self.routes[:, dst_rows] = self.routes[:, src_rows]
        self.state.move(src_rows, dst_rows)
        for a, b in rows:
            if a in occupant:  # a finished row of a moving group has left occupant already
                occupant[b], bound[b], sent[b], prompt_len[b] = occupant.pop(a), bound.pop(a), sent.pop(a), \
                    prompt_len.pop(a)
        for g, h in zip(movers, holes):
            if g in ended_in_group:
                ended_in_group[h] = ended_in_group.pop(g)
        moved_from = {a for a, _ in rows}
        taken = {b for _, b in rows}
        free[:] = sorted((set(free) - taken) | moved_from)
        self.stats.compactions += 1

    def _step_groups(self, groups: int) -> int:
        """The group bucket a GroupCache step over groups 0..groups-1 runs at (compiled: at least 2)."""
        return max(_bucket(groups), 2 if self._step_compiled else 1)

    def _step_slots(self, rows: int) -> int:
        """The slot bucket a step over slots 0..rows-1 runs at (compiled: at least 2, see generate)."""
        return max(_bucket(rows), 2 if self._step_compiled else 1)

    def _finish_early(self, ended: set[int], occupant, done, queue, requests, answered) -> list[int]:
        """Requests a feed finished: their rows stop (slots freed at this sync point); those not
        started yet leave the queue with empty results."""
        rows = [slot for slot, (t, _) in occupant.items() if t in ended and slot not in done]
        if rows:
            self.state.alive[_queued(self.state.alive.device, rows)] = False
        for t in [t for t in queue if t in ended]:
            queue.remove(t)
            for s in range(requests.pop(t).n):
                answered(GenResult(t, s, torch.zeros(0, dtype=torch.long), torch.zeros(0), False))
        return done + rows

    def _stream(self, occupant, sent, S: int, on_tokens) -> None:
        counts = self.state.count[:S].cpu()
        width = max((int(counts[slot]) for slot in occupant), default=0)  # freed slots keep old counts
        lo = min((sent[slot] for slot in occupant), default=0)  # only columns not streamed yet cross to the host
        toks = self.state.out_tok[:S, lo:width].cpu()
        for slot, (i, s) in occupant.items():
            n = int(counts[slot])
            if n > sent[slot]:
                on_tokens(i, s, toks[slot, sent[slot] - lo:n - lo].tolist())
                sent[slot] = n

    def _harvest(self, done, occupant, answered) -> None:
        st = self.state
        idx = _queued(st.count.device, done)
        counts = st.count[idx].cpu().tolist()
        stopped = st.stopped[idx].cpu().tolist()
        width = max(counts)
        toks = st.out_tok[idx, :width].cpu()
        logps = st.out_logp[idx, :width].cpu()
        routes, read = self._harvest_routes(idx) if self._recording else (None, None)
        for j, slot in enumerate(done):
            i, s = occupant[slot]
            res = GenResult(i, s, toks[j, :counts[j]].clone(), logps[j, :counts[j]].clone(), bool(stopped[j]),
                            None if routes is None else routes[:, j, :read[j]].clone())
            self.stats.tokens += counts[j]
            answered(res)

    def _harvest_routes(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The finished rows' routes [L, rows, T, k] (CPU) and how many positions each has: its KV
        length, i.e. the prompt and every generated token but the last, which no step read while
        the row was alive (later steps of a finished row write over that position)."""
        read = self.state.length[idx].cpu().tolist()
        routes = self.routes[:, idx, :max(read)].cpu()
        for j, n in enumerate(read):
            if bool((routes[:, j, :n] == NO_ROUTE).any()):
                raise RuntimeError("route recording: a decode step did not record its routes (the router hooks "
                                   "were not in the compiled step); generate with compile=False "
                                   "(rollout.compile=false)")
        return routes, read

    def _image_features(self, prompts: list[Prompt], device) -> ImageFeatures | None:
        """The vision tower over the prompts' images, each pixel tensor once: prompts that share one
        (a multi-turn rollout's continuing conversations of one prompt, its G samples) read the same
        feature rows, as a request's n samples do; a conversation's own tool images follow its
        prompt's rows."""
        distinct = {}  # id(pixel tensor) -> (its index among the distinct ones, the tensor, its grid)
        sources = [[distinct.setdefault(id(x), (len(distinct), x, g))[0] for x, g in p.pieces()]
                   for p in prompts]  # each prompt's distinct tensors, in its images' order
        if not distinct:
            return None
        pieces = list(distinct.values())
        # the pixels in the dtype the tower's patch embedding casts them to (the same values), cast on the host
        pixels = joined_to_device([x for _, x, _ in pieces], device, self._pixel_dtype)
        feats = encode_images(self.core, pixels, torch.cat([g for _, _, g in pieces]), [len(g) for _, _, g in pieces])
        none = torch.zeros(0, dtype=torch.long, device=device)
        feats.rows_per_prompt = [torch.cat([feats.rows_per_prompt[k] for k in source]) if source else none
                                 for source in sources]
        return feats

    def _kv_dtypes(self, device) -> tuple[torch.dtype, ...]:
        """Each layer's key dtype: the usual one (_kv_dtype), or the dtype a precision override runs
        the layer's attention in (train/precision.py marks each module it wraps with
        `_vlforge_compute`; the innermost of the model, the language model, the layer and its
        attention decides): an fp32 attention's keys are fp32 as in training, not rounded to bf16."""
        usual, out = self._kv_dtype(device), []
        outer = [getattr(m, "_vlforge_compute", None) for m in (self.core, self.core.model, self.lm)]
        for layer in self.lm.layers:
            marks = [d for d in (*outer, getattr(layer, "_vlforge_compute", None),
                                 getattr(layer.self_attn, "_vlforge_compute", None)) if d is not None]
            out.append(marks[-1] if marks else usual)
        return tuple(out)

    def _kv_dtype(self, device) -> torch.dtype:
        """The dtype the layers' keys come out in (the compute dtype under autocast)."""
        if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda")
        if device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            return torch.get_autocast_dtype("cpu")
        dtype = self.lm.layers[0].self_attn.k_proj.weight.dtype
        # a quantized k_proj (bitsandbytes NF4/int8: integer storage; FP8) keeps its keys in the dtype
        # of the unquantized activations, the embeddings'
        return dtype if dtype.is_floating_point and dtype.itemsize >= 2 else self.lm.embed_tokens.weight.dtype


def _check(i: int, r: GenRequest) -> None:
    if r.n < 1 or r.max_new_tokens < 1 or len(r.prompt.input_ids) == 0 or r.temperature < 0:
        raise ValueError(f"request {i}: needs n >= 1, max_new_tokens >= 1, a non-empty prompt and "
                         f"temperature >= 0 (got n={r.n}, max_new_tokens={r.max_new_tokens}, "
                         f"{len(r.prompt.input_ids)} prompt tokens, temperature={r.temperature})")


_MODES = ("greedy", "sample", "filter")  # each also serves the rows of the ones before it, token for token


def _mode(requests: list[GenRequest], at_least: str) -> str:
    """The sampling mode the requests need (never below `at_least`: rows already running keep theirs)."""
    if any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in requests):
        need = "filter"
    elif any(r.temperature > 0 for r in requests):
        need = "sample"
    else:
        need = "greedy"
    return max(need, at_least, key=_MODES.index)


def _queued(device: torch.device, values: list) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without a sync (a blocking copy to a GPU would wait
    for every kernel queued before it)."""
    return host_to_device(torch.tensor(values), device)


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
