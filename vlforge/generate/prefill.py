"""The prefill's inputs and outputs around the model's forward (Runner.prefill runs it): the admitted
prompts as one left-padded batch built on the host, their images through the vision tower once per
pixel tensor, and the prefill's MoE routes copied into the rows' slots."""

from __future__ import annotations

import torch

from vlforge.generate.forward import ImageFeatures, encode_images, rope_positions
from vlforge.generate.requests import Prompt
from vlforge.generate.routes import NO_ROUTE
from vlforge.model.host_inputs import joined_to_device


def host_batch(core, prompts: list[Prompt], pad_id: int, image_token_id: int):
    """(ids [B, P], mask [B, P], M-RoPE positions [3, B, P], each prompt's next position [B]), built
    on the host: every host read of a device tensor (and every blocking copy to it) would stall
    the CPU until the GPU's queue drains, so the caller queues these to the device."""
    P = max(len(p.input_ids) for p in prompts)
    ids_BP = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask_BP = torch.zeros_like(ids_BP)
    for b, p in enumerate(prompts):
        ids_BP[b, P - len(p.input_ids):] = p.input_ids.cpu()
        mask_BP[b, P - len(p.input_ids):] = 1
    grids = [g for p in prompts for _, g in p.pieces()]
    grid = torch.cat(grids) if grids else None
    pos_3BP = rope_positions(core, ids_BP, mask_BP, image_token_id, grid)  # on the host
    return ids_BP, mask_BP, pos_3BP, pos_3BP.amax(dim=(0, 2)) + 1


def prefill_mask(mask_BP: torch.Tensor, text_config) -> torch.Tensor:
    """The attention mask of a padded prefill batch: under sdpa, the one transformers' sdpa_mask builds
    from the 2-D mask (a key attends where it is at or before the query and not padding), made here
    4-D on the device, which masking_utils takes as it is. Given the 2-D mask, masking_utils first
    reads its values on the host (whether is_causal may replace it): a sync. Another attention
    implementation (eager's additive masks, flash's unpadding) gets the 2-D mask, as before."""
    if getattr(text_config, "_attn_implementation", None) != "sdpa":
        return mask_BP
    P = mask_BP.shape[1]
    at = torch.arange(P, device=mask_BP.device)
    return (at[None, :] <= at[:, None])[None, None] & mask_BP.bool()[:, None, None, :]


def pixel_dtype(core) -> torch.dtype | None:
    """The dtype Qwen3-VL's patch embedding casts pixels to (its conv weight's), None for another tower."""
    weight = getattr(getattr(getattr(core.model.visual, "patch_embed", None), "proj", None), "weight", None)
    return weight.dtype if weight is not None and weight.dtype.is_floating_point else None


def image_features(core, prompts: list[Prompt], device) -> ImageFeatures | None:
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
    pixels = joined_to_device([x for _, x, _ in pieces], device, pixel_dtype(core))
    feats = encode_images(core, pixels, torch.cat([g for _, _, g in pieces]), [len(g) for _, _, g in pieces])
    none = torch.zeros(0, dtype=torch.long, device=device)
    feats.rows_per_prompt = [torch.cat([feats.rows_per_prompt[k] for k in source]) if source else none
                             for source in sources]
    return feats


def fill_routes(routes: torch.Tensor, slots_M: torch.Tensor, kept: dict, rows_M: torch.Tensor,
                lengths_M: torch.Tensor, P: int) -> None:
    """The prefill's expert ids (per layer [B*P, k] over the left-padded prompts) into the slots'
    positions 0.. of `routes` [L, slots, length, k], padding stripped, as SlotCache.fill copies the
    KV; every other position of those slots is NO_ROUTE until a decode step writes it (so the
    harvest sees one it did not)."""
    L, k = routes.shape[0], routes.shape[-1]
    if len(kept) != L:
        raise RuntimeError(f"route recording: the prefill ran {len(kept)} of the {L} MoE routers")
    kept_LBPk = torch.stack([kept[p].view(-1, P, k) for p in range(L)])
    j = torch.arange(P, device=slots_M.device)
    src_MP = (P - lengths_M[:, None] + j[None]).clamp(max=P - 1)
    got_LMPk = kept_LBPk[:, rows_M].gather(2, src_MP[None, :, :, None].expand(L, -1, -1, k))
    got_LMPk = got_LMPk.masked_fill((j[None] >= lengths_M[:, None])[None, :, :, None], NO_ROUTE)
    routes[:, slots_M] = NO_ROUTE
    routes[:, slots_M, :P] = got_LMPk.to(routes.dtype)
