"""NF4 expert stacks: reading bitsandbytes' parametrized MoE expert weights (model/quant.quantize_experts
makes them) without more dequantization than a step needs.

    state = nf4_state(experts, "gate_up_proj")            # bitsandbytes' QuantState, or None if plain
    w = routed_expert_weights(experts, "gate_up_proj", ids)  # [S, out, in] for the routed pairs only

Below model/quant.py (which quantizes) and model/moe_lora.py (whose forward reads them), importing
neither.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.utils.parametrize as P
from torch import nn


def nf4_state(module: nn.Module, name: str):
    """bitsandbytes' QuantState of a parametrized expert weight, or None for a plain one."""
    if not P.is_parametrized(module, name):
        return None
    return next((p.quant_state for p in module.parametrizations[name] if hasattr(p, "quant_state")), None)


def dequantize_flat(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit over the flat values, viewed as `state.shape`. Its CPU kernel
    (0.50) takes a [..., n] shape as rows of n and gets the blocks wrong when n is not a multiple
    of the block size (tiny-moe's down_proj, n = 32: 4x NF4's error); a flat shape is one row,
    right on every backend, and the same values."""
    import bitsandbytes.functional as bnb_functional

    flat = copy.copy(state)
    flat.shape = torch.Size((state.shape.numel(),))
    return bnb_functional.dequantize_4bit(packed, flat).view(state.shape)


@functools.cache
def flat_dequantization(parametrization: type) -> type:
    """bitsandbytes' Bnb4bitParametrization dequantizing through `dequantize_flat` (its state-dict
    hook finds it as a subclass)."""

    class FlatNF4(parametrization):
        @torch.no_grad()
        def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
            return dequantize_flat(quantized_param, self.quant_state)

    return FlatNF4


def expert_weight_dtype(experts: nn.Module, name: str) -> torch.dtype:
    """The dtype the experts compute weight `name` in (NF4: the one it dequantizes to), without
    dequantizing it."""
    state = nf4_state(experts, name)
    return state.dtype if state is not None else experts._parameters[name].dtype


def routed_pays(pairs: int, experts: int) -> bool:
    """Dequantize only the routed experts when a step has at most half as many (token, expert) pairs
    as there are experts. Each pair dequantizes its expert's blocks (duplicates included: counting
    the distinct ones would cost a host sync), so the work is pairs/experts of the whole stack's,
    plus the gathers; measured for one 30B-A3B layer (bench/nf4_experts.py, docs/benchmarks.md): on
    the CPU 11.6x less time at 8 pairs, 2.7x at 32, 1.1-1.45x at 64 of 128, slower than the whole
    stack at 120; on an H100 1.45x at 8, 1.8x at 32, 1.5x at 64 (120 not measured routed)."""
    return 2 * pairs <= experts


def routable(experts: nn.Module, name: str) -> bool:
    """Weight `name` is an NF4 stack whose experts are whole blocks, and nothing else parametrizes it
    (routed_expert_weights can gather its experts)."""
    state = nf4_state(experts, name)
    return (state is not None and len(experts.parametrizations[name]) == 1
            and (state.shape[1] * state.shape[2]) % state.blocksize == 0)


def routed_expert_weights(experts: nn.Module, name: str, ids: torch.Tensor) -> torch.Tensor | None:
    """[S, out, in]: the NF4 weight `name` of expert ids[s] for each routed (token, expert) pair s,
    dequantizing only those experts' blocks; None when the weight is not NF4 or its 64-value blocks
    straddle experts.

    Hand-written around bitsandbytes' kernels because its parametrization dequantizes the whole
    [E, out, in] stack on every access: a decode step of a few tokens routes them to S << E
    experts (30B-A3B: 8 of 128 per token), and dequantizing those costs S/E of it. Each expert's
    values are whole blocks, stored contiguously (expert-major), so its packed bytes and scales are
    rows of a [E, ...] view; the double-quantized scales are dequantized whole first (1/64 of the
    values), as bitsandbytes' dequantize_4bit does, then the gathered blocks go through that kernel.
    """
    import bitsandbytes.functional as bnb_functional

    if not routable(experts, name):
        return None
    state = nf4_state(experts, name)
    E, rows, cols = state.shape
    per_expert = rows * cols
    absmax = state.absmax
    if state.nested:
        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    packed = experts.parametrizations[name].original.view(E, per_expert // 2)
    routed = bnb_functional.QuantState(absmax=absmax.float().view(E, -1)[ids].reshape(-1),
                                       shape=torch.Size((ids.numel(), rows, cols)), code=state.code,
                                       blocksize=state.blocksize, quant_type=state.quant_type, dtype=state.dtype)
    return dequantize_flat(packed[ids].reshape(-1, 1), routed)
