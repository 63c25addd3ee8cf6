"""What one generate call fixes before its first step, decided once into a Plan: which cache layout
its rows use, whether its steps replay CUDA graphs and run the compiled step, whether they use
the fused projections or record MoE routes, and what a captured graph bakes in (the weights it
reads, the mask dtype, the model's mode, autocast). Graphs are keyed by (slots, length bucket,
sampling mode, plan): a graph captured under one plan is never replayed under another.

Also the facts about a model the plan reads: whether its decode step can run as a CUDA graph, and
the dtype of each layer's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlforge.generate.cache import bucket
from vlforge.generate.routes import router_modules
from vlforge.model.nf4 import expert_weight_dtype
from vlforge.model.quant import expert_modules
from vlforge.model.tiers import fsdp_sharded


@dataclass(frozen=True)
class Plan:
    group: int  # GroupCache's G: every request has n = G >= 2 samples and none joins later (0: SlotCache)
    graphs: bool  # decode steps are captured as CUDA graphs and replayed (else run eager, step by step)
    compiled: bool  # the torch.compile'd decode step (decode.CompiledStep; only with graphs)
    fusing: bool  # the forwards run the fused q/k/v and gate/up projections (generate/fused.py)
    recording: bool  # MoE: each token's experts are recorded (generate/routes.py)
    # which weight tensors the steps read (their storage): a graph captured over other tensors (GRPO's
    # rollout reads bf16 copies of fp32 masters, PrecisionPolicy.inference_weights) is not replayed
    weights: int
    mask_dtype: torch.dtype  # the additive step mask's dtype: the usual KV dtype (a layer computing in another casts it)
    training: bool  # the model's mode when the call started
    autocast: torch.dtype | None  # CUDA autocast's dtype while the call runs (None: off)
    # the projections run on FP8 copies (generate/fp8.py, GRPO's rollout.precision=fp8) instead of
    # the weights (fused or not): a graph captured over either is replayed only for it
    fp8: bool = False

    @property
    def floor(self) -> int:
        """The fewest slots (GroupCache: groups) a step runs: torch.compile specializes a dimension of
        size 1 (dynamic=True or not), so a one-row step would compile the language model again (~2 min
        at 2B): a compiled step runs at least 2."""
        return 2 if self.compiled else 1

    def step_slots(self, rows: int) -> int:
        """The slot bucket a step over slots 0..rows-1 runs at."""
        return max(bucket(rows), self.floor)

    def step_groups(self, groups: int) -> int:
        """The group bucket a GroupCache step over groups 0..groups-1 runs at."""
        return max(bucket(groups), self.floor)


def cuda_autocast() -> torch.dtype | None:
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def graphs_possible(core, use_graphs: bool | None, device) -> bool:
    """Whether the model's decode step runs as a CUDA graph on `device` (use_graphs: the engine's
    setting; None decides here)."""
    if device.type != "cuda":
        return False
    if use_graphs is not None:
        return use_graphs
    text_config = getattr(core.config, "text_config", core.config)
    if router_modules(core):
        impl = getattr(text_config, "_experts_implementation", None)
        if impl in (None, "eager"):
            # transformers' reference loop over experts asks the host which experts got tokens (a
            # sync per layer): a CUDA graph cannot capture it (grouped_mm / batched_mm can)
            return False
        # NF4 experts (bitsandbytes' parametrization, the routed path at few rows) decode under capture
        # as eagerly (tests/test_moe_quant.py's gpu probe, passed on an H100 on 2026-12-05)
        experts = list(expert_modules(core).values())
        if impl == "grouped_mm" and experts and expert_weight_dtype(experts[0], "gate_up_proj") != torch.bfloat16:
            # torch's grouped GEMM kernel is bf16; other dtypes take its fallback, which copies the
            # group offsets to the host (capture fails: measured on the H200 with fp32 weights)
            return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return False
    return not fsdp_sharded(core)  # FSDP2, even on one process: its hooks must run on every forward


def kv_dtypes(core, lm, device) -> tuple[torch.dtype, ...]:
    """Each layer's key dtype: the usual one (kv_dtype), or the dtype a precision override runs
    the layer's attention in (train/precision.py marks each module it wraps with
    `_vlforge_compute`; the innermost of the model, the language model, the layer and its
    attention decides): an fp32 attention's keys are fp32 as in training, not rounded to bf16."""
    usual, out = kv_dtype(lm, device), []
    outer = [getattr(m, "_vlforge_compute", None) for m in (core, core.model, lm)]
    for layer in lm.layers:
        marks = [d for d in (*outer, getattr(layer, "_vlforge_compute", None),
                             getattr(layer.self_attn, "_vlforge_compute", None)) if d is not None]
        out.append(marks[-1] if marks else usual)
    return tuple(out)


def kv_dtype(lm, device) -> torch.dtype:
    """The dtype the layers' keys come out in (the compute dtype under autocast)."""
    if device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    dtype = lm.layers[0].self_attn.k_proj.weight.dtype
    # a quantized k_proj (bitsandbytes NF4/int8: integer storage; FP8) keeps its keys in the dtype
    # of the unquantized activations, the embeddings'
    return dtype if dtype.is_floating_point and dtype.itemsize >= 2 else lm.embed_tokens.weight.dtype
