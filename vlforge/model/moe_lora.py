"""LoRA on the fused MoE experts as activations: no [E, out, in] update weight is ever built.

peft puts LoRA on a 3-D expert parameter with a `ParamWrapper` that, on every forward, registers a
parametrisation folding the update into the weight (`W + s * B @ A` for all E experts, one baddbmm)
and runs the experts on that folded copy. For Qwen3-VL-30B-A3B that is a new [128, 1536, 2048] +
[128, 2048, 768] tensor (1.2 GB in bf16) per MoE layer per forward, built twice (torch evaluates a
parametrisation once more when it is registered, to check it): 2.4 GB allocated per layer and
forward, every decode step of a rollout included; the expert GEMM keeps the copy for backward,
which also computes its [E, out, in] gradient (1.2 GB more). Here the experts compute, for each routed
(token, expert) pair,

    y = x W_e^T + s * (dropout(x) A_e^T) B_e^T

through the same kernel the base path uses (transformers' grouped GEMM, its batched bmm, or its
eager loop over experts, as `config._experts_implementation` says), so the extra work is two thin
GEMMs of rank r and the extra memory is the [S, r] intermediate (S = tokens x top-k).

peft's wrappers stay in the model: state dict names, save, load, merge, `merge_and_unload` and
`disable_adapter` are all peft's. Only the outermost wrapper of each experts module changes class
(`FusedExpertsLoRA`, a ParamWrapper subclass) so its forward reads every wrapper's lora_A/lora_B,
scaling, dropout, active/disabled/merged state and the frozen base parameters directly, and never
runs the parametrisation. The factor layout is peft's own (`ParamWrapper.get_delta_factors`: the
update of expert e is `s * lhs[e] @ rhs[e]` in the parameter's layout; `delta_factors` repeats
its reshapes without its read of the base weight).

Why not transformers' `ExpertsInterface` (integrations/moe.py: a registry of experts forwards
picked by `config._experts_implementation`)? Its functions receive the experts module and the
routing only, and peft's wrapper forward runs (and folds) before the experts module is reached;
the wrapper is the one place that sees both the adapters and the routing, so the forward lives
there and dispatches on the registry's own key for the kernel.

Unlike peft's path, dropout works here: x can be factored out of the update once it is applied as
activations, so each (token, expert) pair's LoRA input gets its own dropout mask, as a dense LoRA
linear's input does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from vlforge.model.nf4 import expert_weight_dtype, nf4_state, routable, routed_expert_weights, routed_pays

# kernels this forward mirrors (transformers' `experts_implementation` values)
KERNELS = ("eager", "grouped_mm", "batched_mm")
WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass
class _Term:
    """One active adapter on one projection, in x @ W form: y += scaling * (dropout(x) @ down[e]) @ up[e]."""

    down: torch.Tensor  # [E, in, r]
    up: torch.Tensor  # [E, r, out]
    scaling: float
    dropout: nn.Module


def delta_factors(layer: ParamWrapper, adapter: str, dtype: torch.dtype):
    """peft's `ParamWrapper.get_delta_factors` (the update of expert e is `scaling * lhs[e] @ rhs[e]`,
    in the parameter's layout), without its read of the base parameter for the dtype: on NF4 experts
    that read dequantizes the whole stack (model/nf4.py), which a decode step never needs. The
    reshapes are peft's (tests/test_moe_quant.py checks they give its factors)."""
    A, B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
    A = A.reshape(layer.num_experts, -1, A.shape[-1])  # [E, r, in]
    B = B.reshape(B.shape[0], -1, layer.num_experts).permute(2, 0, 1)  # [E, out, r]
    lhs, rhs = (B, A) if layer._did_swap_in_out_features else (A.transpose(-2, -1), B.transpose(-2, -1))
    return lhs.to(dtype), rhs.to(dtype), layer.scaling[adapter]


def _term(layer: ParamWrapper, adapter: str, transposed: bool) -> _Term:
    dtype = expert_weight_dtype(experts_base(layer), layer.parameter_name)
    lhs, rhs, scaling = delta_factors(layer, adapter, dtype)  # update of expert e = scaling * lhs[e] @ rhs[e]
    if transposed:  # parameter [E, in, out], used as x @ W: lhs [E, in, r], rhs [E, r, out]
        down, up = lhs, rhs
    else:  # [E, out, in] (transformers' default), used as x @ W^T: lhs = B [E, out, r], rhs = A [E, r, in]
        down, up = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
    return _Term(down, up, scaling, layer.lora_dropout[adapter])


def _aligned(term: _Term) -> _Term:
    """The grouped GEMM needs 16-byte aligned row strides: B as a row-major [E, r, out] copy (peft
    stores it expert-minor, strides (1, E, r*E) here), and r zero-padded to a multiple of 16 bytes
    (r=4 in bf16 would not be; the padding adds nothing to the product and gets no gradient that
    reaches the adapter)."""
    r = term.down.shape[-1]
    pad = -r % (16 // term.down.element_size())
    down, up = term.down, term.up.contiguous()
    if pad:
        down, up = F.pad(down, (0, pad)), F.pad(up, (0, 0, 0, pad))
    return _Term(down, up, term.scaling, term.dropout)


def experts_base(layer: nn.Module) -> nn.Module:
    """The transformers experts module under a chain of ParamWrappers."""
    while isinstance(layer, ParamWrapper):
        layer = layer.base_layer
    return layer


def expert_wrapper(layer: nn.Module, parameter_name: str) -> ParamWrapper:
    """The ParamWrapper of `parameter_name` in the chain at an experts module's place."""
    while isinstance(layer, ParamWrapper):
        if layer.parameter_name == parameter_name:
            return layer
        layer = layer.base_layer
    raise KeyError(f"no peft ParamWrapper for {parameter_name} on {type(layer).__name__}")


def _unsupported(experts: nn.Module) -> str | None:
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj") and hasattr(experts, "_apply_gate")):
        return f"{type(experts).__name__} is not a transformers fused-experts module (gate_up_proj, down_proj)"
    for attr, ok in (("has_gate", True), ("has_bias", False), ("has_post_expert_norm", False),
                     ("_is_expert_parallel", False)):
        if getattr(experts, attr, ok) != ok:
            return f"{type(experts).__name__} has {attr}={not ok}, which the low-rank expert forward does not implement"
    return None


class FusedExpertsLoRA(ParamWrapper):
    """The outermost peft ParamWrapper of an experts module, with the low-rank forward (module docstring)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                **kwargs) -> torch.Tensor:
        if kwargs:  # peft's mixed-adapter batches (adapter_names=...): ParamWrapper refuses them too
            raise TypeError(f"lora.{type(self).__name__} does not support {sorted(kwargs)}")
        experts = experts_base(self)
        transposed = getattr(experts, "is_transposed", False)
        terms: dict[str, list[_Term]] = {}
        layer = self
        while isinstance(layer, ParamWrapper):  # peft's semantics per wrapper, as its own forward has them
            if layer.disable_adapters:
                if layer.merged:
                    layer.unmerge()
            elif not layer.merged:  # merged: the update is in the base weight already
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        terms.setdefault(layer.parameter_name, []).append(_term(layer, adapter, transposed))
            layer = layer.base_layer
        return lora_experts_forward(experts, hidden_states, top_k_index, top_k_weights, terms)


# peft recognises its wrappers by class name in places (tuners_utils: adding a second adapter to a
# wrapped parameter), so the subclass keeps ParamWrapper's
FusedExpertsLoRA.__name__ = ParamWrapper.__name__


class _Redequantized(torch.autograd.Function):
    """y = mm(x, weight()) for an NF4 expert stack that `weight` dequantizes on each call: backward
    dequantizes it again instead of autograd keeping the forward's dequantized copy (one bf16 copy of
    every MoE layer's stacks until backward: 58 GB for 30B-A3B), as bitsandbytes' MatMul4Bit does for
    Linear4bit (its expert parametrization runs outside autograd's view). Each kernel here computes
    y_s = x_s @ W[e_s] for every row s (grouped GEMM, a bmm of gathered experts, or of the routed
    pairs' own), so dx = the same kernel on dy with W transposed; W gets no gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, mm) -> torch.Tensor:
        ctx.weight, ctx.mm = weight, mm
        return mm(x, weight())

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return ctx.mm(dy, ctx.weight().transpose(-2, -1)), None, None


def _mlp(experts: nn.Module, weights: dict, terms: dict[str, list[_Term]], mm, x: torch.Tensor):
    """gate_up -> gate -> down for rows x, each projection `mm(x, weight)` plus its LoRA terms; a
    weight given as a callable (an NF4 stack's dequantization) goes through _Redequantized."""

    def linear(x, name):
        w = weights[name]
        y = _Redequantized.apply(x, w, mm) if callable(w) else mm(x, w)
        for t in terms.get(name, ()):
            y = y + mm(mm(t.dropout(x), t.down) * t.scaling, t.up)
        return y

    return linear(experts._apply_gate(linear(x, "gate_up_proj")), "down_proj")


def _stack(experts: nn.Module, name: str, transposed: bool) -> torch.Tensor:
    """The weight as [E, in, out] (y = x @ W[e]); reading an NF4 stack dequantizes it."""
    p = getattr(experts, name)
    return p if transposed else p.transpose(-2, -1)


def lora_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, terms: dict[str, list[_Term]]) -> torch.Tensor:
    """transformers' experts forward (gate_up -> gate -> down, routing-weighted sum over the top-k)
    with each projection's LoRA terms added as activations. hidden_states [T, H], top_k_index and
    top_k_weights [T, k]; `terms` maps "gate_up_proj" / "down_proj" to their active adapters (none:
    exactly the base forward). The kernel is `experts.config._experts_implementation`'s."""
    kernel = experts.config._experts_implementation
    if kernel not in KERNELS:
        raise ValueError(f"experts implementation {kernel!r}: the low-rank expert LoRA forward runs on "
                         f"{', '.join(KERNELS)}; use one (model.experts_implementation) or tiers.expert_lora=peft")
    transposed = getattr(experts, "is_transposed", False)
    T, k = top_k_index.shape
    S = T * k  # routed (token, expert) pairs
    ids = top_k_index.reshape(-1)  # [S], pair s = (token s // k, its s % k-th expert)
    # NF4 stacks under autograd: dequantized in forward and again in backward (_Redequantized), never
    # kept; the eager loop indexes one expert per call, so it keeps transformers' way
    redequantize = torch.is_grad_enabled() and nf4_state(experts, "gate_up_proj") is not None
    if routed_pays(S, experts.num_experts) and not transposed and all(routable(experts, n) for n in WEIGHTS):
        # NF4 experts, a decode-sized step: dequantize only the routed ones, one bmm over the pairs

        def routed(name):
            return routed_expert_weights(experts, name, ids).transpose(-2, -1)

        weights = {name: functools.partial(routed, name) if redequantize else routed(name) for name in WEIGHTS}
        terms = {name: [_Term(t.down[ids], t.up[ids], t.scaling, t.dropout) for t in ts] for name, ts in terms.items()}
        y = _mlp(experts, weights, terms, lambda x, w: torch.bmm(x.unsqueeze(1), w).squeeze(1),
                 hidden_states.repeat_interleave(k, dim=0))
        return (y * top_k_weights.reshape(S, 1)).view(T, k, -1).sum(dim=1).to(hidden_states.dtype)
    if redequantize and kernel != "eager":
        weights = {name: functools.partial(_stack, experts, name, transposed) for name in WEIGHTS}
    else:
        weights = {name: _stack(experts, name, transposed) for name in WEIGHTS}  # [E, in, out]: y = x @ W[e]

    def mlp(mm, x):
        return _mlp(experts, weights, terms, mm, x)

    if kernel == "eager":  # transformers' reference loop over the experts that got tokens
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=experts.num_experts).permute(2, 1, 0)  # [E, k, T]
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            pos, tok = torch.where(mask[e])
            y = mlp(lambda x, w, e=e: x @ w[e], hidden_states[tok]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    if kernel == "batched_mm":  # one bmm over the pairs, each with its expert's matrices gathered
        y = mlp(lambda x, w: torch.bmm(x.unsqueeze(1), w[ids]).squeeze(1), hidden_states.repeat_interleave(k, dim=0))
        y = y * top_k_weights.reshape(S, 1)
        return y.view(T, k, -1).sum(dim=1).to(hidden_states.dtype)

    # grouped_mm: pairs sorted by expert, one grouped GEMM per matrix (transformers' dispatcher:
    # torch's grouped_mm where it runs, else its own loop)
    from transformers.integrations.moe import _grouped_mm  # same signature in transformers 5.17 and 5.24

    terms = {name: [_aligned(t) for t in ts] for name, ts in terms.items()}
    ids_g, perm = torch.sort(ids)
    # histc, not bincount: no host sync under CUDA graphs (as transformers); CPU histc takes floats only
    counts = torch.histc(ids_g.float() if ids_g.device.type in ("cpu", "mps") else ids_g.int(),
                         bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    y = mlp(lambda x, w: _grouped_mm(x, w, offs), hidden_states[perm // k])
    y = y * top_k_weights.reshape(S)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(S, device=perm.device)
    return y[inv].view(T, k, -1).sum(dim=1).to(hidden_states.dtype)


def nf4_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """The forward of an NF4 experts module without LoRA (model/quant.quantize_experts sets it): a
    step routing few (token, expert) pairs (decoding a few sequences: model/nf4.routed_pays)
    dequantizes only the routed experts, and a training step dequantizes the stacks again in
    backward rather than keep them (both lora_experts_forward); otherwise (inference, or the eager
    reference loop) transformers' own forward runs on the whole dequantized stack."""
    kernel = self.config._experts_implementation
    if routed_pays(top_k_index.numel(), self.num_experts) or (torch.is_grad_enabled() and kernel != "eager"):
        return lora_experts_forward(self, hidden_states, top_k_index, top_k_weights, {})
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights)


def _outermost_wrappers(model: nn.Module):
    """The ParamWrappers no other ParamWrapper wraps (peft nests one per targeted parameter)."""
    for parent in model.modules():
        if not isinstance(parent, ParamWrapper):
            yield from (child for child in parent.children() if isinstance(child, ParamWrapper))


def fuse_expert_lora(model: nn.Module) -> int:
    """Give every experts module that carries peft parameter LoRA the low-rank forward (in place;
    `model` may be the peft model or the HF model inside it). Returns how many were switched."""
    n = 0
    for wrapper in _outermost_wrappers(model):
        experts = experts_base(wrapper)
        if problem := _unsupported(experts):
            raise ValueError(f"expert LoRA: {problem}; set tiers.expert_lora=peft")
        wrapper.__class__ = FusedExpertsLoRA  # a ParamWrapper still: peft's save / merge / unload see no change
        n += 1
    return n


def unfuse_expert_lora(model: nn.Module) -> int:
    """Back to peft's own (folding) forward, e.g. for a comparison in one process."""
    n = 0
    for wrapper in _outermost_wrappers(model):
        if type(wrapper) is FusedExpertsLoRA:
            wrapper.__class__ = ParamWrapper
            n += 1
    return n
