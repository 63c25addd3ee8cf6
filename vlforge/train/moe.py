"""Mixture-of-experts training signals: the router load-balancing loss, per-step expert load, and
the rollout's routes followed (router replay).

    routing = Routing.of(model, coef)             # None for a dense model
    with capture(routing, batch["attention_mask"]) as routed:
        loss_sum, _ = sft_loss_sum(model, batch)   # the step's own forward: no second one
    loss = loss + aux_term(routing, routed, parts=1)  # coef x aux, fp32
    row.update(routing.step_metrics())            # expert load since the last call

    with follow(routing, route_rows(rollout, seqs), replay=True):   # GRPO: forward and backward
        with capture(routing, mask) as routed:
            logp = sequence_logprobs(...)         # the rollout's experts; moe/route_flip counted
        loss.backward()                           # checkpointing's recomputation replays them too

The router logits come from forward hooks on every `mlp.gate` (transformers'
`Qwen3VLMoeTextTopKRouter`, whose output[0] is the logits [tokens, E]), active only inside
`capture`: the recipes call the backbone themselves (logits only where labels are, shared image
features in GRPO), so the HF forward's `output_router_logits` path, which computes the loss in
the top-level forward from recorded outputs, is never entered. Hooks also leave gradient
checkpointing's recomputation (in backward, after `capture` has closed) out of the count.

Router replay ("rollout routing replay", R3): the rollout's decode (its own kernels, one token
at a time, bf16) and the trainer's full-sequence forward can pick different top-k experts for
the same token where two router probabilities nearly tie, so the trainer's log-probs are of
another computation than the ones the tokens were sampled from. `follow` installs the rollout's
recorded expert ids (generate/routes.py): the hooks count how often the router's own top-k set
differs (moe/route_flip, every policy forward of the update, so later mini-batches include the
step's own updates as ratio_mean does) and, with replay, hand the experts the recorded ids with
the router's own probabilities of those experts, renormalised over the k as the router
renormalises its top-k: the router keeps its gradient (through those probabilities) when
trained, and a token whose route was not recorded (its response's last, never run in the
rollout) keeps its own.

Shapes: L MoE layers, N = B*T token rows (padding included, masked out), E experts, k = top-k.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from vlforge.generate.routes import NO_ROUTE, recorder_of, router_modules  # noqa: F401 (router_modules: used here)
from vlforge.model.tiers import unwrap


def load_balancing_loss(logits_L_NE: list[torch.Tensor], top_k: int, mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021, eqs. 4-6) as transformers computes
    it for Qwen3-VL-MoE (`load_balancing_loss_func`), in fp32:

        loss = E * sum_e f_e * P_e
        f_e  = share of the top-k assignments that go to expert e   (sums to k; no gradient)
        P_e  = mean router probability of expert e                  (sums to 1)

    both pooled over every layer's unmasked tokens. Balanced routing gives k (Switch's k = 1
    gives 1); the coefficient therefore means what `router_aux_loss_coef` means in the model's
    own config.json (0.001 for Qwen3-VL-30B-A3B).
    """
    E = logits_L_NE[0].shape[-1]
    device = logits_L_NE[0].device
    counts_E = torch.zeros(E, dtype=torch.float32, device=device)
    probs_E = torch.zeros(E, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    w_N = None if mask_N is None else mask_N.reshape(-1).to(device=device, dtype=torch.float32)
    for logits_NE in logits_L_NE:
        probs_NE = F.softmax(logits_NE.float(), dim=-1)
        top_Nk = probs_NE.topk(top_k, dim=-1).indices
        w = torch.ones(probs_NE.shape[0], device=device) if w_N is None else w_N
        counts_E = counts_E.scatter_add(0, top_Nk.reshape(-1), w.repeat_interleave(top_k))
        probs_E = probs_E + (probs_NE * w[:, None]).sum(0)
        rows = rows + w.sum()
    rows = rows.clamp(min=1.0)
    return E * torch.sum((counts_E / rows) * (probs_E / rows))


def load_metrics(counts_LE: torch.Tensor, layers: list[int] | None = None) -> dict:
    """Expert-load summaries from assignment counts [L, E] (top-k choices of unmasked tokens) of
    the MoE layers `layers` (the model's layer index of each row; default 0..L-1).

    Per layer: max_load = the busiest expert's share of assignments (1/E when balanced, 1/k
    when every token goes to the same k experts), entropy = load entropy / log E (1 balanced,
    0 collapsed), unused = experts that got no token (Qwen3-VL-MoE has no expert capacity, so no
    token is ever dropped: unused experts are how its collapse shows). Each is logged as the mean
    over layers and as its own worst over layers (highest max_load, lowest entropy, most unused),
    each with the layer it comes from (the first such layer on a tie; moe/worst_layer is
    max_load's): the worst three can be three layers. A collapse in one layer shows, and the row
    stays 9 numbers whatever the depth.
    """
    counts_LE = counts_LE.double()
    layers = list(range(counts_LE.shape[0])) if layers is None else layers
    total_L1 = counts_LE.sum(-1, keepdim=True).clamp(min=1)
    share_LE = counts_LE / total_L1
    E = counts_LE.shape[-1]
    max_load_L = share_LE.max(-1).values
    entropy_L = -(share_LE * share_LE.clamp(min=1e-30).log()).sum(-1) / math.log(E)
    unused_L = (counts_LE == 0).sum(-1).double()
    busiest, flattest, emptiest = int(max_load_L.argmax()), int(entropy_L.argmin()), int(unused_L.argmax())
    return {"moe/max_load_mean": float(max_load_L.mean()), "moe/max_load_worst": float(max_load_L[busiest]),
            "moe/worst_layer": layers[busiest],
            "moe/entropy_mean": float(entropy_L.mean()), "moe/entropy_worst": float(entropy_L[flattest]),
            "moe/entropy_worst_layer": layers[flattest],
            "moe/unused_mean": float(unused_L.mean()), "moe/unused_worst": int(unused_L[emptiest]),
            "moe/unused_worst_layer": layers[emptiest]}


@dataclass
class Routed:
    """One forward's router logits, layer by layer, and its token mask."""

    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, E]
    mask_N: torch.Tensor | None = None
    top_k: int = 1
    flips: torch.Tensor | None = None  # [2]: (token, layer) pairs whose top-k set differs from the rollout's, pairs

    def aux_loss(self) -> torch.Tensor:
        layers = [self.logits[i] for i in sorted(self.logits)]
        return load_balancing_loss(layers, self.top_k, self.mask_N)

    def counts(self) -> torch.Tensor:
        """Top-k assignment counts [L, E] of the unmasked tokens (no gradient)."""
        rows = []
        for i in sorted(self.logits):
            logits_NE = self.logits[i].detach()
            top = logits_NE.float().topk(self.top_k, dim=-1).indices  # softmax is monotone: same choice
            w = torch.ones(logits_NE.shape[0], device=top.device) if self.mask_N is None \
                else self.mask_N.reshape(-1).to(top.device, torch.float32)
            rows.append(torch.zeros(logits_NE.shape[-1], device=top.device).scatter_add(
                0, top.reshape(-1), w.repeat_interleave(self.top_k)))
        return torch.stack(rows)


class Routing:
    """The router hooks of one MoE model and the expert load counted since the last step_metrics().

    The hooks are registered once and do nothing outside `capture` (evaluation, generation): one
    set of hooks for the model's life, so torch.compile'd decoder layers see no new hook per step."""

    def __init__(self, routers: list[tuple[int, nn.Module]], top_k: int, coef: float = 0.0):
        self.routers, self.top_k = routers, top_k
        self.coef = coef  # loss.router_aux_loss_coef
        layers = sorted({i for i, _ in routers})
        self.layers, self.n_layers = layers, len(layers)  # the model's index of each MoE layer, in counts' row order
        self._routed: Routed | None = None
        self._follow: tuple[torch.Tensor, bool] | None = None  # (recorded expert ids [L, N, k], replay)
        self._counts: torch.Tensor | None = None  # [L, E] on the model's device: no host sync per micro-batch
        self._flips: torch.Tensor | None = None  # [2] like Routed.flips, since the last step_metrics
        self._aux: list[torch.Tensor] = []
        self._position = {layer: p for p, layer in enumerate(layers)}  # the row of the layer in recorded routes
        self._handles = [m.register_forward_hook(self._hook(i, self._position[i])) for i, m in routers]

    def attach(self, model: nn.Module) -> None:
        """Run another copy of the model's routers (GRPO's FSDP2-sharded KL reference, the same layers)
        through these hooks too, as a deepcopy of the policy carries them: inside `follow` it takes
        the rollout's experts as well."""
        routers = router_modules(model)
        if [i for i, _ in routers] != [i for i, _ in self.routers]:
            raise RuntimeError("router hooks: the copy's MoE layers differ from the policy's")
        self._handles += [m.register_forward_hook(self._hook(i, self._position[i])) for i, m in routers]

    def _hook(self, layer: int, p: int):
        # torch.compile must not trace the hook: the layer index it closes over would be a guard, and
        # the one compiled MoE block would recompile for every layer (past the recompile limit, the
        # later layers would run uncompiled)
        @torch.compiler.disable
        def keep(module, args, output):
            routed, follow = self._routed, self._follow
            if routed is not None:
                routed.logits[layer] = output[0]
            if follow is None:
                return None
            logits_NE, _, own_Nk = output
            recorded_Nk = follow[0][p]
            if recorded_Nk.shape != own_Nk.shape:
                raise RuntimeError(f"router replay: layer {layer} routes {tuple(own_Nk.shape)} token rows x "
                                   f"experts, the rollout recorded {tuple(recorded_Nk.shape)}")
            valid_N = recorded_Nk[:, 0] != NO_ROUTE
            recorded_Nk = recorded_Nk.to(own_Nk.device, torch.long)
            if routed is not None:  # the step's own forward (not checkpointing's recomputation): count
                differ_N = (own_Nk.sort(-1).values != recorded_Nk.sort(-1).values).any(-1) & valid_N
                pair = torch.stack([differ_N.sum(), valid_N.sum()]).double()
                routed.flips = pair if routed.flips is None else routed.flips + pair
            if not follow[1]:
                return None
            return (logits_NE, *replayed(logits_NE, own_Nk, recorded_Nk, valid_N))
        return keep

    @classmethod
    def of(cls, model: nn.Module, coef: float = 0.0) -> "Routing | None":
        routers = router_modules(model)
        if not routers:
            return None
        recorder_of(unwrap(model))  # the rollout's recording hooks, before anything compiles the model
        return cls(routers, routers[0][1].top_k, coef)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def follow(self, routes_LNk: torch.Tensor, replay: bool):
        """The forwards inside, and their backwards (gradient checkpointing recomputes them there, and
        must take the same experts), run beside the rollout's expert ids [L, N, k] of their N token
        rows (NO_ROUTE where none): counted against the routers' own inside `capture` and, with
        `replay`, used in their place."""
        if routes_LNk.shape[0] != self.n_layers:
            raise RuntimeError(f"router replay: routes of {routes_LNk.shape[0]} layers for {self.n_layers} MoE layers")
        self._follow = (routes_LNk, replay)
        try:
            yield
        finally:
            self._follow = None

    @contextlib.contextmanager
    def capture(self, mask: torch.Tensor | None):
        """Router logits of the forwards run inside, for the rows of `mask` ([B, T] or [N])."""
        routed = Routed(mask_N=None if mask is None else mask.reshape(-1), top_k=self.top_k)
        self._routed = routed
        try:
            yield routed
        finally:
            self._routed = None
        if routed.logits:
            counts = routed.counts()
            self._counts = counts if self._counts is None else self._counts + counts
        if routed.flips is not None:
            self._flips = routed.flips if self._flips is None else self._flips + routed.flips

    def record_aux(self, value: torch.Tensor) -> None:
        self._aux.append(value.detach())

    def step_metrics(self, world=None) -> dict:
        """The expert-load summaries (and mean aux loss, and the route-flip rate when the rollout's
        routes were followed) since the last call, every rank's tokens; one device-to-host copy."""
        several = world is not None and world.size > 1
        if self._counts is None and not several:
            return {}
        # Several ranks: the sums below are collectives, so a rank that counted nothing this step (GRPO
        # with dynamic sampling can leave it only padding forwards, which are not captured) still takes
        # part, with zeros; otherwise its next collective would pair with the others' sums.
        weight = self.routers[0][1].weight  # [E, H] (a DTensor's shape and device are the global / local ones)
        counts = self._counts if self._counts is not None else torch.zeros(
            (self.n_layers, weight.shape[0]), dtype=torch.float32, device=weight.device)
        shape = counts.shape
        flips = self._flips if self._flips is not None else counts.new_zeros(2)  # no routes followed
        host = torch.cat([counts.flatten().double(), flips.double().to(counts.device)]).cpu()
        if several:
            host = torch.tensor(world.sums(*host.tolist()), dtype=torch.float64)
        counts, flips = host[:-2].reshape(shape), host[-2:]
        aux_total, aux_n = (float(torch.stack(self._aux).float().sum()), len(self._aux)) if self._aux else (0.0, 0)
        if several:
            aux_total, aux_n = world.sums(aux_total, aux_n)
        self._counts, self._flips, self._aux = None, None, []
        if counts.sum() == 0:  # no rank counted a token
            return {}
        row = load_metrics(counts, self.layers)
        if flips[1] > 0:  # (token, layer) pairs of the step's policy forwards whose top-k set flipped
            row["moe/route_flip"] = float(flips[0] / flips[1])
        if aux_n:  # the mean over every rank's forwards, as one process accumulating them would log
            row["moe/aux_loss"] = aux_total / aux_n
        return row


def capture(routing: Routing | None, mask: torch.Tensor | None):
    """`routing.capture(mask)`, or a context yielding None for a dense model (the recipes' one line)."""
    return contextlib.nullcontext(None) if routing is None else routing.capture(mask)


def follow(routing: Routing | None, routes_LNk: torch.Tensor | None, replay: bool):
    """`routing.follow(routes, replay)`, or a null context for a dense model or a rollout without routes."""
    if routing is None or routes_LNk is None:
        return contextlib.nullcontext()
    return routing.follow(routes_LNk, replay)


def replayed(logits_NE: torch.Tensor, own_Nk: torch.Tensor, recorded_Nk: torch.Tensor, valid_N: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [N, k], expert ids [N, k]) for the experts: the recorded ids where valid_N
    (the router's own elsewhere), weighted as transformers' Qwen3VLMoeTextTopKRouter weights its
    own top-k: fp32 softmax over all E, the k taken, renormalised to sum 1 (Qwen3-VL-MoE's
    norm_topk_prob), cast to the logits' dtype. Where the ids are the router's own this is its
    output exactly; the weights' gradient reaches the router's logits."""
    experts_Nk = torch.where(valid_N[:, None], recorded_Nk, own_Nk)
    weights_Nk = F.softmax(logits_NE, dim=-1, dtype=torch.float).gather(-1, experts_Nk)
    weights_Nk = weights_Nk / weights_Nk.sum(dim=-1, keepdim=True)
    return weights_Nk.to(logits_NE.dtype), experts_Nk


def aux_term(routing: Routing | None, routed: Routed | None, parts: int) -> torch.Tensor | float:
    """`coef x` the load-balancing loss of one of `parts` forwards whose mean the step takes (0.0
    for a dense model); the unscaled value is kept for the step's `moe/aux_loss`."""
    if routing is None or routed is None or not routed.logits:
        return 0.0
    aux = routed.aux_loss()
    routing.record_aux(aux)
    return routing.coef * aux / parts if routing.coef else 0.0
