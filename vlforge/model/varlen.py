"""Variable-length attention (flash kernels over cu_seqlens), shared by packed training rows
(engine/packed_attention.py) and the vision tower (here).

    varlen_kernel       the entry point this torch offers (VarlenKernel), or None
    flash_capable       whether a CUDA device runs its flash kernels (sm80+)
    half_dtype          the half precision an attention call runs in (the query's or autocast's)
    VISION_ATTENTION    the vision tower's attention: every image of a forward in one varlen call
    use_vision_varlen   switch a loaded Qwen3-VL's vision tower to it (model.vision_attention=varlen)

Why the vision tower needs one: transformers' Qwen3-VL vision attention, under sdpa, makes one SDPA
call per image in every block (a Python loop over the images' lengths: 8 images x 24 blocks = 192
calls a forward, each with its host cost, the eager prefill and training step being host-bound at
2B), and under torch.compile the loop runs over host ints. Only its flash-attention branch takes every
image at once, by cu_seqlens; flash-attn is no dependency of ours (nor installed where we measure),
torch's flash kernels are. VISION_ATTENTION is a registered transformers attention implementation whose
name contains "flash", so the vision attention takes that branch (transformers decides by the name:
utils.generic.is_flash_attention_requested, 5.17-5.24) and hands it cu_seq_lens and max_length. It
runs the varlen kernel (not causal) where it can (CUDA sm80+, half precision, no dropout), else SDPA
per image over the same cu_seqlens: exactly the sdpa branch's computation. Only the vision config
switches; the language model keeps its own implementation, and nothing of it is saved
(`_attn_implementation` is not written to config.json).

Which entry point: torch's public `torch.nn.attention.varlen.varlen_attn` is a Python custom op around
the aten flash kernel (`aten::_flash_attention_forward`, differentiable by its own derivative, traced by
inductor as an extern kernel). The wrapper's host cost, measured in the 8B LoRA step's profile on an
H200 (docs/benchmarks.md, sixteenth session): 262 us a forward call against the aten op's 87 us inside
it, 275 us a backward call, plus a fill kernel a call for its unused rng state; the vision blocks and
the 2B step are host-bound, so that cost is step time. Where the aten op has the signature we call
(2.11 and 2.14, where we run, do: tests/test_vision_attention.py pins it), we call it directly; else
varlen_attn.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VISION_ATTENTION = "vlforge_flash_vision"  # "flash" in the name: transformers' varlen branch (above)


@dataclass(frozen=True)
class VarlenKernel:
    """A variable-length attention entry point: `attend(q, k, v, cu_seqlens, max_len, causal, scale)`,
    q [T, Hq, D], k/v [T, Hk, D] in half precision (Hk dividing Hq: grouped-query attention),
    cu_seqlens int32 [n+1] (the same for queries and keys), max_len an upper bound of every
    sequence's length -> [T, Hq, D]. `takes_scale`: whether a scale other than D**-0.5 can be given."""

    name: str  # "aten_flash" or "varlen_attn"
    attend: Callable
    takes_scale: bool


def _aten_flash(q, k, v, cu_seqlens, max_len: int, causal: bool, scale: float | None):
    # positional up to return_debug_mask (dropout 0: ours never drops attention weights); GQA is native to the kernel
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, causal,
                                                   False, scale=scale)[0]


_ATEN_FLASH_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                    "return_debug_mask")


def aten_flash_kernel() -> VarlenKernel | None:
    """The aten flash op where this torch build has it with the signature _aten_flash calls."""
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None or not torch.backends.cuda.is_flash_attention_available():
        return None
    names = [a.name for a in op.default._schema.arguments]
    if tuple(names[:len(_ATEN_FLASH_ARGS)]) != _ATEN_FLASH_ARGS or "scale" not in names:
        return None
    return VarlenKernel("aten_flash", _aten_flash, takes_scale=True)


def public_varlen_kernel() -> VarlenKernel | None:
    """torch's varlen_attn (2.9+). Its signature changed across releases (is_causal=, then
    window_size=(-1, 0) for causal, then enable_gqa=): the call adapts to what is there."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = frozenset(inspect.signature(varlen_attn).parameters)

    def attend(q, k, v, cu_seqlens, max_len, causal, scale):
        kwargs = {}
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:  # older releases: repeat the KV heads (what transformers' sdpa path does with a mask)
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if "window_size" in params:
            kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kwargs["is_causal"] = causal
        if "scale" in params:
            kwargs["scale"] = scale
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)

    return VarlenKernel("varlen_attn", attend, takes_scale="scale" in params)


@functools.cache
def varlen_kernel() -> VarlenKernel | None:
    """The entry point to use: the aten op, else varlen_attn, else None (the per-sample SDPA fallback)."""
    return aten_flash_kernel() or public_varlen_kernel()


_FLASH_CAPABLE: dict[int, bool] = {}


@torch.compiler.assume_constant_result  # a compiled caller bakes the answer in (a plain dict: dynamo would trace into a functools.cache)
def flash_capable(device_index: int) -> bool:
    if device_index not in _FLASH_CAPABLE:  # flash kernels: Ampere and newer
        _FLASH_CAPABLE[device_index] = torch.cuda.get_device_capability(device_index)[0] >= 8
    return _FLASH_CAPABLE[device_index]


def half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half precision this attention runs in, or None: the query's own, or under CUDA autocast
    the autocast dtype. With fp32 master weights (precision.master_weights) Qwen3's q/k RMSNorm
    returns fp32 (its fp32 weight promotes), so the query arrives in fp32 although SDPA, on
    autocast's lower-precision list, would run it in bf16: varlen_attn must do the same cast, or
    every packed layer falls back to the per-sample loop (measured on the H200: it did)."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


def kernel_takes(query: torch.Tensor, dropout: float, scaling: float | None, kernel: VarlenKernel | None = None) -> bool:
    """Whether the varlen `kernel` (varlen_kernel(), looked up outside compiled code: inspect and the
    schema are not traceable) can take this call: a CUDA device that runs its flash kernels, half
    precision (the query's or autocast's), no dropout (its dropout is fixed at 0), a head size the
    flash kernel takes, a scale it can be given. Static facts only: a compiled caller guards on
    them once."""
    if kernel is None or not query.is_cuda or not flash_capable(query.device.index or 0):
        return False
    if half_dtype(query) is None or dropout > 0:
        return False
    D = query.shape[-1]
    if D % 8 or D > 256:
        return False
    return kernel.takes_scale or scaling is None or abs(scaling - D ** -0.5) < 1e-12 * D ** -0.5


def _vision_varlen(query_HTD, key_HTD, value_HTD, cu_seqlens, max_len: int | None, scaling):
    """The varlen kernel over the images of one row, not causal: [H, T, D] each -> [1, T, H, D].
    `max_len`: the longest image's patches (None: read from cu_seqlens, a sync on a GPU)."""
    dtype = half_dtype(query_HTD)  # autocast's cast, as SDPA gets it
    q, k, v = (x.transpose(0, 1).to(dtype).contiguous() for x in (query_HTD, key_HTD, value_HTD))
    # compiled, the row length bounds every image's (the kernel sizes its grid by it; blocks past an
    # image's end exit at once), so the graph does not guard on the host int of the longest image
    if torch.compiler.is_compiling():
        max_len = q.shape[0]
    elif max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return _KERNEL.attend(q, k, v, cu_seqlens.to(torch.int32), max_len, False, scaling)[None]


@torch.compiler.disable  # loops over host lengths: out of compiled graphs
def _vision_per_image(query, key, value, bounds: tuple[int, ...], dropout, scaling):
    """SDPA over each image's slice of the row (`bounds`: host cu_seqlens), as transformers' sdpa
    branch computes it ([1, H, T, D] each -> [1, T, H, D])."""
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                           scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _vision_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                      cu_seq_lens_k=None, max_length_q=None, max_length_k=None, is_causal=False, image_bounds=None,
                      **kwargs):
    """The vision tower's attention over all images of the forward: query/key/value [1, H, T, D],
    images delimited by cu_seq_lens_q (= cu_seq_lens_k) -> ([1, T, H, D], None). `image_bounds`:
    the same bounds on the host (model/host_inputs.VisionGrid passes them with the tower's other
    precomputed inputs), which the per-image fallback reads instead of the device tensor."""
    if cu_seq_lens_q is None:  # a call without images' bounds (not the vision attention's varlen branch)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None or is_causal or query.shape[0] != 1:
        raise ValueError("the vision attention takes one row of images, no mask, not causal")
    if kernel_takes(query, dropout, scaling, _KERNEL):
        return _vision_varlen(query[0], key[0], value[0], cu_seq_lens_q, max_length_q, scaling), None
    bounds = image_bounds if image_bounds is not None else tuple(cu_seq_lens_q.tolist())  # (a sync on a GPU)
    return _vision_per_image(query, key, value, bounds, dropout, scaling), None


def use_vision_varlen(model) -> bool:
    """Switch a Qwen3-VL (dense or MoE) vision tower from sdpa to VISION_ATTENTION (True if it now
    uses it); another implementation (eager, flash_attention_2, flex) stays as chosen."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    config = getattr(visual, "config", None)
    if config is None or not hasattr(visual, "blocks"):
        return False
    if config._attn_implementation == "sdpa":
        config._attn_implementation = VISION_ATTENTION
    return config._attn_implementation == VISION_ATTENTION


_KERNEL = varlen_kernel()  # looked up once, outside any compiled vision block
AttentionInterface.register(VISION_ATTENTION, _vision_attention)
