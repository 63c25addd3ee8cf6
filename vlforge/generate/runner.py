"""The runner: the model's work for the engine, on the device. It owns what lives across calls (the
KV buffers and the per-slot state, the CUDA graphs and their memory pool, the compiled step, the
fused projections, the MoE route recorder) and runs what a call's Plan says: the prefill of
admitted requests into their slots, and decode steps, eager or captured once per (slot bucket,
length bucket, sampling mode, plan) as a CUDA graph and replayed. Every host read of a device
tensor in a call is here: the sync point (`alive`) and the harvest of finished rows.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext

import torch

from vlforge.generate import decode
from vlforge.generate.cache import DECODE_ATTENTION, GROUPED_ATTENTION, GroupCache, SlotCache, attention_as, \
    per_layer, step_mask
from vlforge.generate.decode import CompiledStep
from vlforge.generate.forward import cache_of, forward_shared
from vlforge.generate.fused import FusedProjections
from vlforge.generate.plan import Plan
from vlforge.generate.prefill import fill_routes, host_batch, image_features, prefill_mask
from vlforge.generate.requests import GenRequest, SlotState
from vlforge.generate.routes import NO_ROUTE, ROUTE_DTYPE, recorder_of
from vlforge.generate.sampling import row_key
from vlforge.model.host_inputs import Placeholders, host_to_device

MIN_BUFFER_ROWS = 4  # slots (GroupCache: groups) the KV buffers hold at least (Runner.ensure_buffers)
MAX_STOP_IDS = 8


def queued(device: torch.device, values: list) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without a sync (a blocking copy to a GPU would wait
    for every kernel queued before it)."""
    return host_to_device(torch.tensor(values), device)


class Runner:
    """Prefill, decode steps and graph capture for one model (held by a weak reference: the runner
    lives as long as its model, not longer)."""

    def __init__(self, core):
        self._core = weakref.ref(core)
        self.lm = core.model.language_model
        self.text_config = self.lm.layers[0].self_attn.config
        self.fused: FusedProjections | None = None  # the model's fusable groups (built at the first call that fuses)
        self.fp8 = None  # generate/fp8.Fp8Projections the calls decode with, while decoding_in_fp8 sets it
        self.fp8_copies = None  # the model's FP8 copies once made (generate/fp8.fp8_projections), kept for refreshes
        self.compiled: CompiledStep | None = None  # built at the first compiled call
        self.cache: SlotCache | None = None
        self.state: SlotState | None = None
        self._largest: dict[int, tuple[int, int]] = {}  # buffer kind (GroupCache's G, 0) -> the largest (slots, length)
        self.graphs: dict = {}  # (S, Lb, mode, plan) -> its CUDA graph
        self.pool = None
        self.capture_s_total = 0.0
        # MoE: the routers' hooks, registered now, before the decode step is first compiled (routes.py: why)
        self.recorder = recorder_of(core)
        self.routes: torch.Tensor | None = None  # [L, slots, length, k] expert ids, when recording

    @property
    def core(self):
        return self._core()

    def release(self) -> None:
        self.cache = self.state = self.routes = None
        self.graphs.clear()
        self.pool = None

    def fuse(self) -> bool:
        """Makes the model's fused projections ready (a first call makes the fused weights views of one
        buffer); whether any projection is fused."""
        if self.fused is None:
            self.fused = FusedProjections(self.core)
        return self.fused.prepare() > 0

    # -- buffers ------------------------------------------------------------------------------

    def ensure_buffers(self, slots: int, length: int, dtype, device, group: int = 0) -> None:
        """KV buffers of at least `slots` rows x `length` positions: a SlotCache, or with group G a
        GroupCache of slots / G groups (reused while large enough and of the same kind and G)."""
        c = self.cache
        kind = getattr(c, "group", 0)
        dtype = per_layer(dtype, self.text_config.num_hidden_layers)
        if c is not None and c.slots * max(kind, 1) >= slots and c.length >= length and c.dtype == dtype and \
                c.keys[0].device == device and kind == group:
            return
        cfg = self.text_config
        # grown, never shrunk, per kind (SlotCache, GroupCache of G): a slot count seen before needs no new compile
        high_slots, high_length = self._largest.get(group, (0, 0))
        slots, length = max(slots, high_slots), max(length, high_length)
        self._largest[group] = (slots, length)
        self.release()  # the graphs point at the old buffers; a pool whose graphs are gone cannot take new captures
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
        self.state = SlotState(slots, length + 1, device)
        self.prompt_span = torch.zeros((), dtype=torch.long, device=device)  # GroupCache: where generated tokens start
        self.arange_L = torch.arange(length, device=device)
        self.stop_ids = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)  # what finished rows emit
        self.banned = torch.zeros(self.core.lm_head.out_features, dtype=torch.bool, device=device)
        self.is_stop = torch.zeros_like(self.banned)  # the stop ids as a mask (min_new_tokens)
        self._masked: tuple | None = None  # the (stop ids, banned ids) the two masks hold now

    def prepare(self, plan: Plan, stop_ids: tuple[int, ...], banned_ids: tuple[int, ...], pad_id: int,
                prompt_span: int) -> None:
        """A call's inputs every step reads, written into the buffers the graphs hold (no slot alive yet).
        The masks are rewritten only when the ids changed: a preset's banned list holds ~151k ids (every
        lm_head row past its small tokenizer), a few ms to rebuild at each batch a server starts."""
        device = self.cache.rows.device
        if plan.group:
            self.prompt_span.fill_(prompt_span)
        if plan.recording and self.routes is None:  # with the slots: a new cache drops it (and the graphs)
            self.routes = torch.full((len(self.recorder.layers), len(self.cache.rows), self.cache.length,
                                      self.recorder.top_k), NO_ROUTE, dtype=ROUTE_DTYPE, device=device)
        if self._masked is None or self._masked[0] != stop_ids or not (
                self._masked[1] is banned_ids or self._masked[1] == banned_ids):
            self._write_masks(stop_ids, banned_ids)
        self.pad.fill_(pad_id)
        self.state.alive.zero_()
        if plan.compiled and self.compiled is None:
            self.compiled = CompiledStep()

    def _write_masks(self, stop_ids: tuple[int, ...], banned_ids: tuple[int, ...]) -> None:
        device = self.cache.rows.device
        self.stop_ids.fill_(-1)
        self.stop_ids[:len(stop_ids)] = queued(device, list(stop_ids))
        self.is_stop.zero_()
        if stop_ids:
            self.is_stop[queued(device, list(stop_ids))] = True
        self.banned.zero_()
        if banned_ids:
            self.banned[queued(device, list(banned_ids))] = True
        self._masked = (stop_ids, banned_ids)

    # -- prefill ------------------------------------------------------------------------------

    def prefill(self, plan: Plan, admitted: list[tuple[int, GenRequest, list[int]]], image_token_id: int,
                pad_id: int, mode: str) -> None:
        """Prefill the admitted requests' prompts in one batch, copy their KV into their slots (GroupCache:
        once into their group) and sample each row's first token from it."""
        device = self.cache.rows.device
        prompts = [r.prompt for _, r, _ in admitted]
        ids_BP, mask_BP, pos_3BP, next_pos_B = host_batch(self.core, prompts, pad_id, image_token_id)
        P = ids_BP.shape[1]
        feats = image_features(self.core, prompts, device)
        # what transformers finds on the device with host reads (each a sync: the host waits for the queued
        # decode steps, then the GPU for the host), from the host copies instead: the image tokens' places
        # (Placeholders: the deepstack layers' writes by index, not boolean masks) and the attention mask
        # (prefill_mask: none when no row is padded, else given 4-D; a 2-D one masking_utils reads for a skip)
        places = Placeholders.of(ids_BP, image_token_id).to(device) if feats is not None else None
        padded = bool((mask_BP == 0).any())
        ids_BP, mask_BP, pos_3BP = (host_to_device(t, device) for t in (ids_BP, mask_BP, pos_3BP))
        mask = prefill_mask(mask_BP, self.text_config) if padded else None
        with self.recorder.keep() if plan.recording else nullcontext({}) as kept, self.fusion(plan):
            out = forward_shared(self.core, ids_BP, mask, pos_3BP, feats, list(range(len(prompts))), use_cache=True,
                                 placeholders=places)
        slots, rows, keys, reqs = [], [], [], []
        for b, (_, r, sl) in enumerate(admitted):
            slots += sl
            rows += [b] * len(sl)
            keys += [row_key(r.seed, r.first_row + i) for i in range(len(sl))]
            reqs += [r] * len(sl)
        slots_M, rows_M = queued(device, slots), queued(device, rows)
        lengths_B = queued(device, [len(p.input_ids) for p in prompts])
        G = plan.group
        if G:  # one copy of each prompt's KV, into its request's group
            if any(sl != list(range(sl[0], sl[0] + G)) or sl[0] % G for _, _, sl in admitted):
                raise RuntimeError("GroupCache: a request's samples must take one whole group")
            groups_B = queued(device, [sl[0] // G for _, _, sl in admitted])
            self.cache.fill(groups_B, cache_of(out), torch.arange(len(prompts), device=device), lengths_B, P)
        else:
            self.cache.fill(slots_M, cache_of(out), rows_M, lengths_B[rows_M], P)
        if plan.recording:
            fill_routes(self.routes, slots_M, kept, rows_M, lengths_B[rows_M], P)
        self._first_tokens(out.last_hidden_state[:, -1][rows_M], slots_M, reqs, keys, mode)
        st = self.state
        st.length[slots_M] = lengths_B[rows_M]
        st.prompt_len[slots_M] = lengths_B[rows_M]
        st.pos[slots_M] = host_to_device(next_pos_B, device)[rows_M]

    def _first_tokens(self, hidden_MH, slots_M, reqs: list[GenRequest], keys: list[int], mode: str) -> None:
        """The rows' sampling settings into their slots and their first token from the prefill's last
        hidden states: lm_head over the slots' rows (not the B prompts'), so each row of every lm_head
        call is one sequence, as in the decode steps."""
        device, st = slots_M.device, self.state
        st.temperature[slots_M] = queued(device, [float(r.temperature) for r in reqs])
        st.top_p[slots_M] = queued(device, [float(r.top_p) for r in reqs])
        st.top_k[slots_M] = queued(device, [int(r.top_k) for r in reqs])
        st.key[slots_M] = queued(device, keys)
        st.max_new[slots_M] = queued(device, [r.max_new_tokens for r in reqs])
        st.min_new[slots_M] = queued(device, [r.min_new_tokens for r in reqs])
        st.count[slots_M] = 0
        tok_M, logp_M = decode.pick(self.core.lm_head(hidden_MH), self.banned, self.is_stop, st.min_new[slots_M] > 0,
                                    st.temperature[slots_M], st.top_k[slots_M], st.top_p[slots_M], st.key[slots_M],
                                    st.count[slots_M], mode)
        st.out_tok[slots_M, 0] = tok_M
        st.out_logp[slots_M, 0] = logp_M
        stop_M = (tok_M[:, None] == self.stop_ids[None]).any(-1)
        st.tok[slots_M] = tok_M
        st.count[slots_M] = 1
        st.stopped[slots_M] = stop_M
        st.alive[slots_M] = ~stop_M & (st.max_new[slots_M] > 1)

    # -- one decode step (the captured part) -----------------------------------------------------

    def step(self, plan: Plan, S: int, Lb: int, mode: str) -> None:
        """One token for each of slots 0..S-1, attention reading Lb positions: the language model, lm_head,
        sampling and the per-row stop / max-token bookkeeping, all tensor ops (no host read: capturable)."""
        st = self.state
        length_S, alive_S = st.length[:S], st.alive[:S]
        span_L = self.arange_L[:Lb]
        # eager: decode's functions, looked up now (tests swap them); compiled: CompiledStep's of the same names
        fns = self.compiled if plan.compiled else decode
        # recording: each row's experts go where its input token's KV goes (length_S, updated by the step)
        routes = self.recorder.write_to(self.routes, self.cache.rows[:S], length_S) if plan.recording \
            else nullcontext()
        if plan.group:
            hidden_SH = self._grouped_hidden(plan, S, Lb, span_L, routes, fns)
        else:
            self.cache.bind(length_S, span_L)
            mask_S11L = step_mask((span_L[None] <= length_S[:, None])[:, None, None, :], plan.mask_dtype)  # own slot too
            with attention_as(self.text_config, DECODE_ATTENTION), routes, self.fusion(plan):
                hidden_SH = fns.decode_hidden(self.core, self.cache, st.tok[:S, None], mask_S11L, st.pos[:S])
        tok_S, logp_S = fns.pick(self.core.lm_head(hidden_SH), self.banned, self.is_stop, st.count[:S] < st.min_new[:S],
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

    def _grouped_hidden(self, plan: Plan, S: int, Lb: int, span_L, routes, fns) -> torch.Tensor:
        """The language model's step over GroupCache's S / G groups: the mask and write positions of a
        group's interleaved layout (the prompt once, then the rows' generated tokens, G to a position)."""
        st, G = self.state, plan.group
        P, qpk = S // G, self.text_config.num_attention_heads // self.text_config.num_key_value_heads
        suffix_S = st.length[:S] - st.prompt_len[:S]  # the input token's index among the row's generated ones
        # a stale row past the call's layout (a padding group's) writes into the spare position, never read
        member_S = self.cache.member_of[:S]
        write_S = (self.prompt_span + suffix_S * G + member_S).clamp(max=self.cache.length)
        self.cache.bind(self.cache.group_of[:S].view(P, G), write_S.view(P, G), span_L)
        off_L = span_L - self.prompt_span
        keep_SL = (span_L[None] < st.prompt_len[:S, None]) | (
            (off_L[None] >= 0) & (off_L[None] % G == member_S[:, None]) & (off_L[None] // G <= suffix_S[:, None]))
        mask_P1QL = step_mask(keep_SL.view(P, G, 1, Lb).expand(P, G, qpk, Lb).reshape(P, 1, G * qpk, Lb),
                              plan.mask_dtype)
        with attention_as(self.text_config, GROUPED_ATTENTION), routes, self.fusion(plan):
            return fns.decode_hidden_grouped(self.core, self.cache, st.tok[:S].view(P, G), mask_P1QL,
                                             st.pos[:S].view(P, G))

    def fusion(self, plan: Plan):
        """The fused projections for the forwards inside, when the plan uses them; a plan in FP8 runs
        the FP8 copies instead (fused as fused.py groups them, generate/fp8.py)."""
        if plan.fp8:
            return self.fp8.installed()
        return self.fused.installed() if plan.fusing else nullcontext()

    def run_steps(self, plan: Plan, S: int, Lb: int, mode: str, steps: int, stats) -> None:
        if not plan.graphs:
            for _ in range(steps):
                self.step(plan, S, Lb, mode)
            return
        key = (S, Lb, mode, plan)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(plan, S, Lb, mode, key, stats)
        for _ in range(steps):
            graph.replay()

    def _capture(self, plan: Plan, S: int, Lb: int, mode: str, key, stats) -> torch.cuda.CUDAGraph:
        start = time.perf_counter()
        saved = [t.clone() for t in self.state.loop_vars()]
        # autocast's weight-cast cache must stay off while capturing (a cached cast made outside
        # the graph would be freed under it)
        ctx = (torch.autocast("cuda", dtype=plan.autocast, cache_enabled=False) if plan.autocast is not None
               else torch.autocast("cuda", enabled=False))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), ctx:
            self.step(plan, S, Lb, mode)  # warm-up (cuBLAS handles, workspaces) before capture
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.state.loop_vars(), saved):
            t.copy_(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), ctx:
            self.step(plan, S, Lb, mode)
        torch.cuda.synchronize()
        self.graphs[key] = graph
        seconds = time.perf_counter() - start
        self.capture_s_total += seconds
        stats.capture_s += seconds
        stats.graphs.append(key[:3])
        return graph

    # -- the rows, as the scheduler moves and finishes them --------------------------------------

    def alive(self, S: int) -> torch.Tensor:
        """Which of slots 0..S-1 still decode, on the host: the sync point (waits for the queued steps)."""
        return self.state.alive[:S].cpu()

    def stop_rows(self, slots: list[int]) -> None:
        self.state.alive[queued(self.state.alive.device, slots)] = False

    def move_rows(self, movers: list[int], holes: list[int], filled: int, plan: Plan) -> None:
        """Compaction (SlotCache): the rows of slots `movers` into slots `holes`, their first `filled`
        KV positions (past them nothing is read), routes and state."""
        device = self.state.tok.device
        src, dst = queued(device, movers), queued(device, holes)
        self.cache.move(src, dst, filled)
        if plan.recording:  # past `filled` NO_ROUTE, so harvest still sees a step that did not record
            self.routes[:, dst] = NO_ROUTE
            self.routes[:, dst, :filled] = self.routes[:, src, :filled]
        self.state.move(src, dst)

    def move_groups(self, movers: list[int], holes: list[int], filled: int, rows: list[tuple[int, int]],
                    plan: Plan) -> None:
        """Compaction (GroupCache): groups `movers` (their prompt's KV and their rows' tokens) into groups
        `holes`; `rows`: the (from, to) slots of their members."""
        device = self.state.tok.device
        self.cache.move(queued(device, movers), queued(device, holes), filled)
        src_rows, dst_rows = queued(device, [a for a, _ in rows]), queued(device, [b for _, b in rows])
        if plan.recording:
            self.routes[:, dst_rows] = self.routes[:, src_rows]
        self.state.move(src_rows, dst_rows)

    def harvest(self, done: list[int], plan: Plan) -> list[tuple]:
        """The finished rows of slots `done` on the host: (tokens, log-probs, stopped, routes or None) each."""
        st = self.state
        idx = queued(st.count.device, done)
        counts = st.count[idx].cpu().tolist()
        stopped = st.stopped[idx].cpu().tolist()
        width = max(counts)
        toks = st.out_tok[idx, :width].cpu()
        logps = st.out_logp[idx, :width].cpu()
        routes, read = self._harvest_routes(idx) if plan.recording else (None, None)
        return [(toks[j, :counts[j]].clone(), logps[j, :counts[j]].clone(), bool(stopped[j]),
                 None if routes is None else routes[:, j, :read[j]].clone()) for j in range(len(done))]

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
