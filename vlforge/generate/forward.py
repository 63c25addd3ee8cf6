"""The model-forward pieces every generation path shares (GRPO rollouts, the trainer's log-probs, eval).

    encode_images       the vision tower, once per prompt image            -> ImageFeatures
    forward_shared      language model over N sequences, image features gathered per sequence
    rope_positions      Qwen3-VL M-RoPE position ids (the model's own get_rope_index)
    filter_logits       top-k / top-p (the sampling distribution only)
    token_logprobs      log_softmax(logits / T) at the given tokens, fp32
    vision_token_ids    the special tokens never sampled

Shapes: N sequences, T tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlforge.data.encode import Encoder
from vlforge.model.host_inputs import Placeholders, RopeIndex, VisionGrid, host_to_device, placeholders_from_host
from vlforge.model.tiers import unwrap

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


@dataclass
class ImageFeatures:
    embeds: torch.Tensor  # [image tokens of all prompts, H], prompts' images in order
    deepstack: list[torch.Tensor]  # per deepstack layer, same rows
    rows_per_prompt: list[torch.Tensor]  # prompt b -> row indices of its image tokens


def encode_images(core, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
                  images_per_prompt: list[int]) -> ImageFeatures | None:
    """One vision-tower pass over every prompt's images (not G times). The grid's derived inputs
    are computed on the host (model/host_inputs.py): a host `grid_thw` costs no sync at all."""
    if pixel_values is None:
        return None
    device, grid = pixel_values.device, grid_thw.cpu()
    visual = core.model.visual
    vision = VisionGrid.of(visual)
    kwargs = vision.kwargs_on(grid, device) if vision is not None else {}
    out = visual(pixel_values, grid_thw=grid if vision is not None else grid_thw, return_dict=True, **kwargs)
    tokens_per_image = (grid.prod(-1) // visual.spatial_merge_size**2).tolist()
    rows, start, image = [], 0, 0
    for n in images_per_prompt:
        count = sum(tokens_per_image[image:image + n])
        rows.append(torch.arange(start, start + count, device=device))
        start, image = start + count, image + n
    deepstack = [d if torch.is_tensor(d) else torch.cat(list(d)) for d in out.deepstack_features]
    return ImageFeatures(out.pooler_output, deepstack, rows)


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x


def cache_of(output):
    """The cache a language-model forward returned (its key was renamed in transformers 5.2x)."""
    return output["cache"] if "cache" in output else output.past_key_values


def forward_shared(core, input_ids_NT: torch.Tensor, attention_mask_NT: torch.Tensor, position_ids_3NT: torch.Tensor,
                   feats: ImageFeatures | None, prompt_of_seq: list[int | tuple[int, ...]], cache=None,
                   use_cache: bool = False, keepalive: torch.Tensor | None = None,
                   placeholders: Placeholders | None = None, **lm_kwargs):
    """Qwen3-VL's language model over N sequences whose image tokens reuse `feats` of their prompt.

    `prompt_of_seq[n]`: the `feats` group (encode_images' images_per_prompt entry) of sequence n's
    image tokens, or a tuple of groups whose features follow one another in its row (a multi-turn
    rollout's sequence: its prompt's, then the images its tools returned).

    Equivalent to the HF forward with each prompt's pixels repeated per sequence (tested), without
    running the vision tower again. Returns the language model output (last_hidden_state, cache).
    `keepalive` (a zero from train/sharding.vision_keepalive) joins the embeddings where image
    features would: a sharded text-only mini-batch then reduces gradients like one with images.
    `lm_kwargs` go to the language model as they are (a packed row's `packed_rows`). `placeholders`
    (the image tokens' places, read from the host copy of `input_ids_NT`, on its device): the image
    features are placed, and the deepstack features added, by index instead of through boolean masks,
    the same values without a sync (model/host_inputs.Placeholders).
    """
    lm = core.model.language_model
    embeds_NTH = lm.embed_tokens(input_ids_NT)
    if keepalive is not None:
        embeds_NTH = embeds_NTH + keepalive.to(embeds_NTH.dtype)
    kwargs = {}
    image_mask_NT = input_ids_NT == core.config.image_token_id
    rows = torch.cat([feats.rows_per_prompt[g] for g in feature_groups(prompt_of_seq)]) if feats is not None else None
    by_index = contextlib.nullcontext()
    if rows is not None and len(rows):  # its length is known on the host: no sync
        image_embeds = feats.embeds[rows].to(embeds_NTH.dtype)
        if placeholders is None:
            embeds_NTH = embeds_NTH.masked_scatter(image_mask_NT[..., None], image_embeds)
        else:  # masked_scatter's backward reads the mask on the host; an index write's backward gathers
            flat_XH = embeds_NTH.reshape(-1, embeds_NTH.shape[-1])
            embeds_NTH = flat_XH.index_put((placeholders.flat_positions,), image_embeds).view_as(embeds_NTH)
            by_index = placeholders_from_host(core.model, placeholders)  # the deepstack layers' writes
        kwargs = {"visual_pos_masks": image_mask_NT, "deepstack_visual_embeds": [d[rows] for d in feats.deepstack]}
    with by_index:
        return lm(inputs_embeds=embeds_NTH, attention_mask=attention_mask_NT, position_ids=position_ids_3NT,
                  use_cache=use_cache, **{_cache_kwarg(type(lm)): cache}, **kwargs, **lm_kwargs)


def feature_groups(prompt_of_seq: list[int | tuple[int, ...]]) -> list[int]:
    """forward_shared's feature groups of the sequences, in row order (a tuple's groups one after another)."""
    return [g for b in prompt_of_seq for g in (b if isinstance(b, tuple) else (b,))]


def rope_positions(core, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int,
                   grid_thw: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor:
    """Qwen3-VL M-RoPE position ids [3, N, T] (the model's own get_rope_index), on `device` (default:
    the inputs'), computed on the host copies (model/host_inputs.RopeIndex): on a GPU, get_rope_index
    reads its inputs on the host several times per prompt; host inputs cost no sync at all."""
    device = device or input_ids.device
    ids, mask = input_ids.cpu(), attention_mask.cpu()
    mm_types = (ids == image_token_id).long()
    if grid_thw is None or not bool(mm_types.any()):
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return host_to_device(pos[None].expand(3, -1, -1).contiguous(), device)
    position_ids, _ = RopeIndex.of(core.model)(ids, mm_types, image_grid_thw=grid_thw.cpu(), attention_mask=mask)
    return host_to_device(position_ids, device)


def token_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.log_softmax(logits_NV.float() / temperature, dim=-1).gather(-1, tokens_N[:, None])[:, 0]


def filter_logits(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus filtering (the sampling distribution only; log-probs use the full one)."""
    if top_k > 0 and top_k < logits_NV.shape[-1]:
        kth = torch.topk(logits_NV, top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_NV, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits_NV = logits_NV.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits_NV


def vision_token_ids(encoder: Encoder) -> list[int]:
    tok = encoder.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in VISION_TOKENS]
    return [i for i in ids if i is not None and i != tok.unk_token_id]


def never_generated(encoder: Encoder, model) -> list[int]:
    """The token ids no answer may contain, the same for rollouts, eval, infer and serve (and the
    trainer's recomputed log-probs mask the same ids): the vision special tokens, the model's
    generation_config suppress_tokens (which transformers' generate honours too), and the ids past the
    tokenizer's vocabulary (an embedding matrix padded to a multiple, as Qwen3-VL's 151,936 rows for
    151,669 tokens): they have no text, so an answer holding them would stream nothing."""
    core = unwrap(model)
    suppress = getattr(getattr(core, "generation_config", None), "suppress_tokens", None) or []
    padded = range(len(encoder.tokenizer), core.lm_head.out_features)
    return list(dict.fromkeys([*vision_token_ids(encoder), *suppress, *padded]))
