"""FP8 copies of the language model's decoder projections, for generation (GRPO's rollout.precision=fp8).

    fp8 = fp8_projections(engine)       # the engine's FP8 copies of its model (made at the first call)
    fp8.refresh()                       # made again from the current weights, in place
    with decoding_in_fp8(engine, fp8):  # the engine's prefills and decode steps inside run on the copies
        engine.generate(...)

What is copied: each decoder layer's q/k/v, o, gate/up and down projections, as float8_e4m3fn with one
scale per output channel (row-wise: the row's amax / 448); each GEMM quantizes its input per token
(dynamic scales): the usual FP8 inference recipe, as vLLM's and verl's FP8 rollouts. The vision tower,
the embeddings, lm_head, the norms and MoE experts keep their own weights. Experts: torchao's
Float8Tensor implements torch._grouped_mm (row-wise scales), but only for a transposed [E, in, out]
operand, and transformers' experts kernels (grouped_mm, batched_mm, the eager loop) index and
transpose the 3-D stacks in ways not tried with it; a copy of every expert is also the memory a MoE
run is short of. So experts decode in their own dtype (bf16), not built in FP8.

The trainer's weights are only read: the copies are tensors of their own, and they replace the
projections' forwards only inside the engine's forwards (Runner.fusion), so nothing the trainer
holds (Parameters, their storage, peft's adapters, an optimizer's references) changes. A LoRA layer's
copy is quantize(W + the sum of its active adapters' scale * B @ A) (peft's get_delta_weight), made
in fp32: inside, the layer's whole forward is the FP8 GEMM, peft's adapter terms being in the weight.

One GEMM per group, as the engine's fused projections (fused.py): q/k/v are one FP8 tensor [q + k + v
out features, in], gate/up another, o and down groups of one. Row-wise scales belong to their row, so
a group's copy is exactly its members' copies stacked; the group's forwards are fused._Group's, with
its GEMM in FP8. The copies' storage is made once and written in place by refresh(), so decode steps
captured as CUDA graphs over them stay valid across GRPO steps (Plan.fp8 keys those graphs apart
from a bf16 call's).

Kernel: torchao's Float8Tensor (its quantization, and its F.linear: the input quantized per row, then
torch._scaled_mm with row-wise scales). Not torchao's quantize_ configs: they swap the module's weight
for the FP8 one in place (the trainer's must stay) and refuse a device below compute capability 8.9
(the CPU included). KernelPreference.TORCH: torch._scaled_mm (cuBLASLt's row-wise FP8 GEMM on CUDA,
a reference kernel on the CPU), the same path on every device, and the one the tests observe.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlforge.generate.engine import Engine
from vlforge.generate.fused import _base, _Group
from vlforge.model.tiers import fsdp_sharded

# a decoder-layer submodule's groups of projections reading one input, each one FP8 GEMM
FP8_GROUPS = {"self_attn": (("q_proj", "k_proj", "v_proj"), ("o_proj",)),
              "mlp": (("gate_proj", "up_proj"), ("down_proj",))}
FP8_DTYPE = torch.float8_e4m3fn
# the smallest amax a scale is made from: a row of zeros (an all-zero activation row, a weight row of
# zeros) would get scale 0 and quantize to NaN (0 / 0); with it, it quantizes to zeros
AMAX_FLOOR = 1e-12


def _float8():
    """torchao's Float8Tensor pieces (imported when FP8 copies are made: torchao is the fp8 extra)."""
    try:
        from torchao.quantization import Float8MMConfig, Float8Tensor, PerRow
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
        from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
    except ImportError:
        raise ImportError('FP8 rollouts need torchao >= 0.18 (its Float8Tensor): pip install -U "torchao>=0.18"') from None
    return Float8Tensor, PerRow, Float8MMConfig, KernelPreference, QuantizeTensorToFloat8Kwargs


def fp8_gemm_problem(device: torch.device) -> str | None:
    """None when torch._scaled_mm runs row-wise FP8 GEMMs on `device`; else why not and what to do.
    CUDA: FP8 tensor cores (compute capability >= 8.9). CPU: tried on a 16 x 16 GEMM, since whether
    torch's CPU kernel takes row-wise scales depends on the torch build (2.11's takes per-tensor
    scales only). And torchao's Float8Tensor, which the copies are."""
    try:
        _float8()
    except ImportError as e:
        return f"rollout.precision=fp8: {e}"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (f"rollout.precision=fp8 needs FP8 tensor cores (compute capability >= 8.9: L4, L40, H100, "
                    f"H200, B200), not {torch.cuda.get_device_name(device)} ({cap[0]}.{cap[1]}): use "
                    "rollout.precision=bf16")
        return None
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device), scale_b=torch.ones(1, 16, device=device),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return (f"rollout.precision=fp8: torch {torch.__version__} has no row-wise FP8 GEMM on the {device.type} "
                f"({str(e).splitlines()[0][:160]}); use rollout.precision=bf16, or a GPU of compute capability >= 8.9")
    return None


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """`weight` [out, in] as torchao's Float8Tensor: float8_e4m3fn, one fp32 scale per row [out, 1]; a
    linear over it quantizes its input per row (token) and runs torch._scaled_mm. `dtype`: the
    activations' (what a GEMM over it returns)."""
    Float8Tensor, PerRow, Float8MMConfig, KernelPreference, ActKwargs = _float8()
    torch_mm = KernelPreference.TORCH
    q = Float8Tensor.from_hp(weight.detach().float(), float8_dtype=FP8_DTYPE, granularity=PerRow(),
                             hp_value_lb=AMAX_FLOOR, kernel_preference=torch_mm)
    return Float8Tensor(q.qdata, q.scale, block_size=q.block_size, mm_config=Float8MMConfig(use_fast_accum=True),
                        act_quant_kwargs=ActKwargs(float8_dtype=FP8_DTYPE, granularity=PerRow(),
                                                   hp_value_lb=AMAX_FLOOR, kernel_preference=torch_mm),
                        kernel_preference=torch_mm, dtype=dtype)


def effective_weight(wrapper: nn.Module) -> torch.Tensor:
    """The weight a projection computes with, in fp32 [out, in]: a linear's own, or a peft LoRA layer's
    base weight plus each active adapter's scale * B @ A (none when its adapters are disabled or merged
    into the base already)."""
    base = _base(wrapper)
    weight = base.weight.detach()
    if not weight.is_floating_point():
        raise ValueError(f"FP8 copies are made from floating-point weights; {type(base).__name__} holds "
                         f"{weight.dtype} (a quantized layer): decode such a model in its own precision")
    weight = weight.float()
    if wrapper is base or wrapper.disable_adapters or wrapper.merged:
        return weight
    for name in wrapper.active_adapters:
        if name not in wrapper.lora_A:
            continue
        if getattr(wrapper, "use_dora", {}).get(name, False):
            raise ValueError("FP8 copies of DoRA layers are not built (their magnitude rescales W + delta)")
        weight = weight + wrapper.get_delta_weight(name).float()
    return weight


class _Fp8Group(_Group):
    """A group of projections (fused.GROUPS' or one alone) whose GEMM reads one FP8 copy of their
    stacked effective weights; installed on the modules the layer calls (a LoRA layer, not its base)."""

    def __init__(self, wrappers: list[nn.Module], dtype: torch.dtype):
        super().__init__(wrappers)
        self.dtype = dtype
        with torch.inference_mode(False), torch.no_grad():  # refresh writes it in place, outside inference mode
            self.buffer = quantize_rows(self.stacked(), dtype)

    def stacked(self) -> torch.Tensor:
        return torch.cat([effective_weight(w) for w in self.wrappers])

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy made again from the current weights, into the same storage (member by member: a
        row's scale is its own, so only one member's fp32 weight is held at a time)."""
        start = 0
        for w, n in zip(self.wrappers, self.sizes):
            q = quantize_rows(effective_weight(w), self.dtype)
            self.buffer.qdata[start:start + n].copy_(q.qdata)
            self.buffer.scale[start:start + n].copy_(q.scale)
            start += n

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        # the output in the dtype the bf16 path gives (autocast's, else the input's); on CUDA the GEMM
        # runs on a bf16 input (the only output dtype of torch._scaled_mm with row-wise scales there)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):  # the quantization's amax and scaling as written
            return F.linear(x.to(torch.bfloat16 if device == "cuda" else dtype), self.buffer).to(dtype)


class Fp8Projections:
    """FP8 copies of the language model's decoder projections (FP8_GROUPS in every decoder layer) of
    `core`, made now from its current weights. `dtype`: the activations' on the CPU (default: the
    embeddings' dtype); on CUDA the GEMMs run in bf16."""

    def __init__(self, core, dtype: torch.dtype | None = None):
        if fsdp_sharded(core):
            raise ValueError("FP8 copies are made from whole weights: a model sharded by FSDP2 is not built")
        lm = core.model.language_model
        dtype = dtype or lm.embed_tokens.weight.dtype
        self.groups: list[_Fp8Group] = []
        for layer in lm.layers:
            for owner, groups in FP8_GROUPS.items():
                module = getattr(layer, owner, None)
                for names in groups:
                    wrappers = [getattr(module, n, None) for n in names]
                    # a MoE layer's mlp has no gate/up/down linears (its experts stay in their dtype)
                    if all(isinstance(_base(w), nn.Linear) and _base(w).bias is None for w in wrappers):
                        self.groups.append(_Fp8Group(wrappers, dtype))

    def refresh(self) -> None:
        """Every copy made again from the current weights (in place)."""
        for g in self.groups:
            g.refresh()

    def copy_of(self, module: nn.Module) -> torch.Tensor:
        """The FP8 copy's rows of one projection (a linear or its LoRA layer), dequantized to fp32."""
        for g in self.groups:
            for i, w in enumerate(g.wrappers):
                if w is module or g.linears[i] is module:
                    start = sum(g.sizes[:i])
                    rows = g.buffer.qdata[start:start + g.sizes[i]]
                    return rows.float() * g.buffer.scale[start:start + g.sizes[i]]
        raise KeyError("not a projection with an FP8 copy")

    @contextmanager
    def installed(self):
        """Inside: each projection's forward is its group's FP8 GEMM (the forwards run inside)."""
        try:
            for g in self.groups:
                for m, forward in zip(g.wrappers, g.forwards):
                    m.forward = forward
            yield
        finally:
            for g in self.groups:
                g.clear()
                for m in g.wrappers:
                    m.__dict__.pop("forward", None)


def fp8_projections(engine: Engine, made: bool = True) -> Fp8Projections | None:
    """The FP8 copies of the engine's model, kept by its runner (made from the weights at the first
    call; the same object after, so its storage stays where captured graphs read it). `made=False`:
    None when none were made yet."""
    runner = engine.runner
    if runner.fp8_copies is None and made:
        runner.fp8_copies = Fp8Projections(engine.core)
    return runner.fp8_copies


@contextmanager
def decoding_in_fp8(engine: Engine, copies: Fp8Projections):
    """The engine's calls inside prefill and decode with `copies` (Plan.fp8)."""
    engine.runner.fp8 = copies
    try:
        yield
    finally:
        engine.runner.fp8 = None
