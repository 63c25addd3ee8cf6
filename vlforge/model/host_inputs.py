"""What Qwen3-VL's forward computes from its inputs with host reads, computed on the host instead.

On a GPU, transformers' Qwen3-VL reads device tensors on the host in several places of a forward
with images: the M-RoPE position ids (`get_rope_index`: per prompt, boolean masks and `tolist`),
the vision tower's grid inputs (`repeat_interleave`, `item`, `tolist`), and with sdpa one
`lengths.tolist()` per vision block. Each read stalls the CPU until the GPU queue drains. These
callables run the model's own code on the host copies of the inputs (the training loader's
workers, the generation engine's prefill), so the values are the model's and the forward gets
them precomputed: transformers' vision forward takes them as kwargs, the language model takes
position_ids.

    RopeIndex       the model class's get_rope_index as a picklable callable of config values
    VisionGrid      the vision tower's grid-derived kwargs (transformers.vision_utils)
    Placeholders    where a batch's image tokens are; placeholders_from_host: the model places the
                    image features and deepstack features there without boolean masks
    causal_padding_mask  the 4-D mask transformers' sdpa path builds for a padded batch, without its check
    host_to_device  a host tensor queued to the device without a sync
    joined_to_device  host tensors concatenated (and cast) into one pinned buffer, queued to the device
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from vlforge.model.varlen import VISION_ATTENTION, ImageBounds

# the vision tower's forward kwargs VisionGrid computes (transformers.vision_utils reads them if given)
# (and image_bounds: model/varlen's per-image fallback reads the images' bounds there, never on the device)
VISION_GRID_KWARGS = ("cu_seqlens", "position_ids", "interp_indices", "interp_weights", "max_seqlen", "image_bounds")


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a host-device sync: a blocking copy to a GPU waits for every kernel
    queued before it (cudaStreamSynchronize); from pinned memory with non_blocking it is queued
    like a kernel (the caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():  # the loader's pin_memory did it
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def joined_to_device(parts: list[torch.Tensor], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.cat(parts) on `device` in `dtype` (default: theirs), queued without a sync. Host parts
    bound for a GPU are concatenated, and cast, straight into one pinned buffer: one host pass over
    the bytes where cat, then pin_memory (host_to_device) make two, and a narrower dtype halves the
    copy (a prefill's 8 images of 448x448 are 38 MB of fp32 pixels, ~20-70 ms a pass on a slow host)."""
    dtype = dtype or parts[0].dtype
    if device.type != "cuda" or any(p.device.type != "cpu" for p in parts):
        return torch.cat(parts).to(device=device, dtype=dtype, non_blocking=True)
    buffer = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, pin_memory=True)
    torch.cat(parts, out=buffer)
    return buffer.to(device, non_blocking=True)


class RopeIndex:
    """The language model's get_rope_index (M-RoPE positions) as a picklable callable of config
    values: the model class's own function, called on this object in place of the model. In
    transformers 5.17-5.24 Qwen3-VL's (and Qwen3-VL-MoE's) get_rope_index reads only
    `self.config.vision_config.spatial_merge_size` and `self.get_vision_position_ids` (arithmetic on
    its arguments), so a DataLoader worker runs the model's own code with no model object in it
    (tests/test_host_syncs.py checks the result equals the model's)."""

    def __init__(self, model_cls: type, config):
        self.model_cls, self.config = model_cls, config

    @classmethod
    def of(cls, core) -> RopeIndex:
        """Of the Qwen3-VL model (core.model of the ForConditionalGeneration)."""
        # the class that defines it: a wrapper's dynamic subclass (FSDP2) would not pickle by name
        owner = next(c for c in type(core).__mro__ if "get_rope_index" in vars(c))
        return cls(owner, core.config)

    def get_vision_position_ids(self, *args, **kwargs):
        return self.model_cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.model_cls.get_rope_index(self, *args, **kwargs)


@dataclass(frozen=True)
class VisionGrid:
    """The vision tower's grid-derived inputs, computed by transformers' own vision_utils (which its
    forward takes precomputed from kwargs: "cu_seqlens", "position_ids", "interp_indices",
    "interp_weights", "max_seqlen"), from a host grid: computed on the device they cost ~10 syncs
    (repeat_interleave, tolist), and with the sequence lengths on the host the sdpa path's per-block
    split (`lengths.tolist()`) reads them there instead of once per block from the device. The
    tower's values (all from its config) are copied here so that it pickles without the tower."""

    num_grid_per_side: int
    interpolation_mode: str
    align_corners: bool
    spatial_merge_size: int
    config: object  # the tower's PretrainedConfig (vision_utils reads its attention implementation)

    @classmethod
    def of(cls, visual) -> VisionGrid | None:
        if not all(hasattr(visual, a) for a in ("num_grid_per_side", "interpolation_mode",
                                                "interpolation_align_corners", "spatial_merge_size")):
            return None  # another vision tower: it computes them itself
        return cls(visual.num_grid_per_side, visual.interpolation_mode, visual.interpolation_align_corners,
                   visual.spatial_merge_size, visual.config)

    def __call__(self, grid: torch.Tensor) -> tuple[dict, dict]:
        """({kwarg: tensor} to move to the device, {kwarg: value} the tower reads on the host)."""
        from transformers.utils.generic import is_flash_attention_requested
        from transformers.vision_utils import (get_vision_attention_seqlens,
                                               get_vision_interpolation_indices_and_weights, get_vision_position_ids)

        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=self.num_grid_per_side, mode=self.interpolation_mode,
            align_corners=self.align_corners, spatial_merge_size=self.config.spatial_merge_size)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid, self.config)
        to_device = {"interp_indices": indices, "interp_weights": weights,
                     "position_ids": get_vision_position_ids(grid, self.spatial_merge_size)}
        host = {"max_seqlen": max_seqlen}
        # varlen kernels read cu_seqlens on the device; the sdpa path splits by it on the host
        (to_device if is_flash_attention_requested(self.config) else host)["cu_seqlens"] = cu_seqlens
        if self.config._attn_implementation == VISION_ATTENTION:
            host["image_bounds"] = ImageBounds(tuple(cu_seqlens.tolist()))
        return to_device, host

    def kwargs_on(self, grid: torch.Tensor, device: torch.device) -> dict:
        """The tower's kwargs for a forward on `device` (the tensors queued there, no sync)."""
        return self.moved(*self(grid), device)

    @staticmethod
    def moved(to_device: dict, host: dict, device: torch.device) -> dict:
        """What __call__ gave (computed elsewhere, e.g. in a loader worker) as kwargs on `device`."""
        return {**{k: host_to_device(v, device) for k, v in to_device.items()}, **host}


@dataclass(frozen=True, eq=False)
class Placeholders:
    """Where a batch's image tokens are, read from its host copy. transformers' Qwen3-VL finds them
    on the device with boolean masks: `get_placeholder_mask` checks their count against the image
    features with an `.item()`, and `_deepstack_process` reads and writes the hidden states through
    the mask at each of the first decoder layers (deepstack: 3 at 2B), a nonzero each way in the
    forward and again in the backward. Each is a sync: the CPU waits for the GPU queue to drain, then
    the GPU waits for the CPU. With the positions as indices the same reads and writes need no sync.
    (On one H200 taking them out changed no step time measurably: the compiled 2B step's host work
    is about as long as its GPU work, so running ahead gains little; docs/benchmarks-log.md, 2026-12-03,
    "FSDP2 + `cpu_offload`". They cost once the host's share shrinks.)"""

    flat_positions: torch.Tensor  # long [N]: row * T + column of each image token, in row-major order
    image_tokens: int  # N

    @classmethod
    def of(cls, input_ids_BT: torch.Tensor, image_token_id: int) -> Placeholders:
        flat = (input_ids_BT.reshape(-1) == image_token_id).nonzero().reshape(-1)  # on the host: no sync
        return cls(flat, len(flat))

    def to(self, device: torch.device) -> Placeholders:
        return Placeholders(host_to_device(self.flat_positions, device), self.image_tokens)


@contextlib.contextmanager
def placeholders_from_host(model, placeholders: Placeholders):
    """Inside, the Qwen3-VL model (`model`: the ForConditionalGeneration's .model) finds its image
    tokens from `placeholders`: the same masks, count check and hidden states as its own methods,
    which it gets back on exit. For batches with images and no video (the joint image + video path
    builds its own masks)."""
    language = model.language_model

    def get_placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is None or video_features is not None:
            raise ValueError("placeholders_from_host: a batch of input_ids with images, no video")
        if image_features is not None and placeholders.image_tokens * inputs_embeds.shape[-1] != image_features.numel():
            raise ValueError(f"Image features and image tokens do not match, tokens: {placeholders.image_tokens}, "
                             f"features: {image_features.shape[0]}")
        device = inputs_embeds.device
        return ((input_ids == model.config.image_token_id).unsqueeze(-1).to(device),
                (input_ids == model.config.video_token_id).unsqueeze(-1).to(device))

    def deepstack_process(hidden_states, visual_pos_masks, visual_embeds):
        # transformers: hidden[mask] = hidden[mask] + embeds; here by index (the mask's order), the same bits
        rows_NH = hidden_states.reshape(-1, hidden_states.shape[-1]).clone()
        at = placeholders.flat_positions
        rows_NH[at] = rows_NH[at] + visual_embeds.to(rows_NH.device, rows_NH.dtype)
        return rows_NH.view_as(hidden_states)

    model.get_placeholder_mask, language._deepstack_process = get_placeholder_mask, deepstack_process
    try:
        yield
    finally:
        del model.get_placeholder_mask, language._deepstack_process


def causal_padding_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """The boolean [B, 1, T, T] mask transformers' sdpa path builds for a padded batch (causal, and
    keys that are not padding: masking_utils.sdpa_mask), built without its check whether the batch
    has padding at all (`padding_mask.all()`, a sync on a GPU): the caller knows that from the host
    copy, and passes no mask for a batch without padding, as transformers then does. A 4-D mask is
    taken as it is (masking_utils._preprocess_mask_arguments)."""
    T = attention_mask_BT.shape[1]
    positions = torch.arange(T, device=attention_mask_BT.device)
    causal_11TT = (positions[None, :] <= positions[:, None])[None, None]
    return causal_11TT & attention_mask_BT.bool()[:, None, None, :]
