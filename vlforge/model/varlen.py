"""torch's variable-length attention (`torch.nn.attention.varlen.varlen_attn`: flash kernels over
cu_seqlens), shared by packed training rows (train/packed_attention.py) and the vision tower (here).

    varlen_kernel       varlen_attn and its parameter names, or None (a torch without it)
    flash_capable       whether a CUDA device runs its flash kernels (sm80+)
    half_dtype          the half precision an attention call runs in (the query's or autocast's)
    VISION_ATTENTION    the vision tower's attention: every image of a forward in one varlen call
    use_vision_varlen   switch a loaded Qwen3-VL's vision tower to it (model.attention.vision=varlen)

Why the vision tower needs one: transformers' Qwen3-VL vision attention, under sdpa, makes one SDPA
call per image in every block (a Python loop over the images' lengths: 8 images x 24 blocks = 192
calls a forward, each with its host cost, the eager prefill and training step being host-bound at
2B), and under torch.compile the loop runs over host ints. Only its flash-attention branch takes every
image at once, by cu_seqlens; flash-attn is no dependency of ours (nor installed where we measure),
torch's varlen_attn is. VISION_ATTENTION is a registered transformers attention implementation whose
name contains "flash", so the vision attention takes that branch (transformers decides by the name:
utils.generic.is_flash_attention_requested, 5.17-5.24) and hands it cu_seq_lens and max_length. It
runs torch's varlen_attn (not causal) where it can (CUDA sm80+, half precision, no dropout), else SDPA
per image over the same cu_seqlens: exactly the sdpa branch's computation. Only the vision config
switches; the language model keeps its own implementation, and nothing of it is saved
(`_attn_implementation` is not written to config.json).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

VISION_ATTENTION = "vlforge_flash_vision"  # "flash" in the name: transformers' varlen branch (above)


@functools.cache
def varlen_kernel():
    """(varlen_attn, its parameter names) or None. Its signature changed across torch releases
    (is_causal=, then window_size=(-1, 0) for causal, then enable_gqa=): callers adapt to what is there."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


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


def kernel_takes(query: torch.Tensor, dropout: float, scaling: float | None, kernel=None) -> bool:
    """Whether torch's varlen_attn (`kernel`: varlen_kernel()'s pair, looked up outside compiled code:
    inspect is not traceable) can take this call: a CUDA device that runs its flash kernels, half
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
    return "scale" in kernel[1] or scaling is None or abs(scaling - D ** -0.5) < 1e-12 * D ** -0.5


def _vision_varlen(query_HTD, key_HTD, value_HTD, cu_seqlens, max_len: int | None, scaling):
    """torch's varlen_attn over the images of one row, not causal: [H, T, D] each -> [1, T, H, D].
    `max_len`: the longest image's patches (None: read from cu_seqlens, a sync on a GPU)."""
    varlen_attn, params = _KERNEL
    dtype = half_dtype(query_HTD)  # autocast's cast, as SDPA gets it
    q, k, v = (x.transpose(0, 1).to(dtype).contiguous() for x in (query_HTD, key_HTD, value_HTD))
    kwargs = {"window_size": (-1, -1)} if "window_size" in params else {"is_causal": False}
    if "scale" in params:
        kwargs["scale"] = scaling
    # compiled, the row length bounds every image's (the kernel sizes its grid by it; blocks past an
    # image's end exit at once), so the graph does not guard on the host int of the longest image
    if torch.compiler.is_compiling():
        max_len = q.shape[0]
    elif max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)[None]


class ImageBounds:
    """The images' cu_seqlens on the host (model/host_inputs.VisionGrid computes them with the tower's
    other inputs), for the per-image fallback. Not a plain tuple: dynamo guards on the length of a
    tuple argument, so a compiled vision block would compile again for every new number of images in
    a batch, and past torch's recompile limit run eager on every input no graph matches (the 2B
    mixed-image step hit it on the H200). An object passed through untouched costs one type guard."""

    __slots__ = ("offsets",)

    def __init__(self, offsets: tuple[int, ...]):
        self.offsets = offsets

    def __eq__(self, other) -> bool:
        return isinstance(other, ImageBounds) and self.offsets == other.offsets

    def __hash__(self) -> int:
        return hash(self.offsets)

    def __repr__(self) -> str:
        return f"ImageBounds{self.offsets}"


@torch.compiler.disable  # loops over host lengths: out of compiled graphs
def _vision_per_image(query, key, value, image_bounds: ImageBounds | None, cu_seqlens, dropout, scaling):
    """SDPA over each image's slice of the row, as transformers' sdpa branch computes it ([1, H, T, D]
    each -> [1, T, H, D]). The bounds are read here, out of the compiled graph, from `image_bounds`,
    or from the device's cu_seqlens (a sync on a GPU) when the caller has no host copy."""
    bounds = image_bounds.offsets if image_bounds is not None else tuple(cu_seqlens.tolist())
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                           scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2)


def _vision_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                      cu_seq_lens_k=None, max_length_q=None, max_length_k=None, is_causal=False, image_bounds=None,
                      **kwargs):
    """The vision tower's attention over all images of the forward: query/key/value [1, H, T, D],
    images delimited by cu_seq_lens_q (= cu_seq_lens_k) -> ([1, T, H, D], None). `image_bounds`
    (ImageBounds): the same bounds on the host (model/host_inputs.VisionGrid passes them with the tower's other
    precomputed inputs), which the per-image fallback reads instead of the device tensor."""
    if cu_seq_lens_q is None:  # a call without images' bounds (not the vision attention's varlen branch)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None or is_causal or query.shape[0] != 1:
        raise ValueError("the vision attention takes one row of images, no mask, not causal")
    if kernel_takes(query, dropout, scaling, _KERNEL):
        return _vision_varlen(query[0], key[0], value[0], cu_seq_lens_q, max_length_q, scaling), None
    return _vision_per_image(query, key, value, image_bounds, cu_seq_lens_q, dropout, scaling), None


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
