"""The trainer's log-probs of a rollout's response tokens (the same forward as generation:
generate.forward), on the padded [n, P + R] batch or packed into one row (rl.packing: PackedLayout).

    sequence_logprobs   the log-probs (and entropies) of the response tokens of some sequences
    route_rows          MoE: the rollout's recorded experts for the token rows sequence_logprobs runs
    token_mask          those token rows' mask, on the host (Rollout.host: the rollout's one host copy)

Log-probs are of the temperature-scaled policy, log_softmax(logits / T), before top-k/top-p
truncation (as verl's actor computes them), in fp32. Shapes as rollout/groups.py.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from vlforge.train.inputs import packed_position_ids_host

from vlforge.train.losses import token_logprobs_entropy

from vlforge.train.sharding import vision_keepalive
from vlforge.train.packed_attention import (PackedRows, packed_forward, per_sample_attention, runs_sdpa,
                                            use_packed_attention)
from vlforge.generate.forward import (ImageFeatures, cache_of, encode_images, feature_groups,  # noqa: F401
                                      filter_logits, forward_shared, never_generated, rope_positions, token_logprobs)
from vlforge.model.host_inputs import Placeholders, causal_padding_mask, host_to_device
from vlforge.model.tiers import unwrap

from vlforge.rollout.groups import Rollout


def route_rows(rollout: Rollout, seq_index: list[int], packing: bool = False) -> torch.Tensor | None:
    """The recorded expert ids [L, N, k] of sequences `seq_index`, row for row as the routers see
    sequence_logprobs' forward: its [n, P + R] tokens flattened (N = n * (P + R)), or, `packing`,
    the packed row's real tokens (PackedLayout, the same mask sequence_logprobs packs by); None
    when the rollout recorded none."""
    if rollout.routes is None:
        return None
    routes_LNk = rollout.routes[:, seq_index].flatten(1, 2)
    if not packing:
        return routes_LNk
    return routes_LNk[:, host_to_device(PackedLayout.of(token_mask(rollout, seq_index)).src_T, routes_LNk.device)]


def token_mask(rollout: Rollout, seq_index: list[int]) -> torch.Tensor:
    """[n, P + R] mask of sequences `seq_index`' token rows (each prompt's, then its response's), on
    the host (Rollout.host): the rows sequence_logprobs runs, and what a packed row keeps of them."""
    host = rollout.host
    prompts = [rollout.prompt_of_seq[s] for s in seq_index]
    return torch.cat([host.prompt_mask[prompts], host.response_mask[seq_index]], dim=1)


def _images_of(pixel_values: torch.Tensor | None, grid: torch.Tensor | None, per_owner: list[int] | None,
               owners: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of just these owners' images, out of `pixel_values` whose patch
    rows are per image, in order, `per_owner[k]` images for owner k (prompts, or a multi-turn
    rollout's sequences); `grid` on the host: the patch bounds without a device read."""
    if pixel_values is None:
        return None, None
    first_image = [0, *itertools.accumulate(per_owner)]
    images = [i for b in owners for i in range(first_image[b], first_image[b + 1])]
    if not images:
        return None, None
    bounds = [0, *torch.cumsum(grid.prod(-1), 0).tolist()]
    rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in images])
    return pixel_values[host_to_device(rows, pixel_values.device)], grid[images]


def _rollout_images(rollout: Rollout, prompts: list[int], seqs: list[int]):
    """One vision-tower input for `prompts`' images and then the tool images of `seqs`:
    (pixel_values, image_grid_thw, images per prompt then per sequence), None for no image."""
    pixels, grid = _images_of(rollout.pixel_values, rollout.host.image_grid_thw, rollout.images_per_prompt, prompts)
    own, own_grid = _images_of(rollout.response_pixel_values, rollout.host.response_image_grid_thw,
                               rollout.images_per_response, seqs)
    counts = [rollout.images_per_prompt[b] for b in prompts] + [rollout.images_per_response[n] for n in seqs]
    if own is not None:
        pixels = own if pixels is None else torch.cat([pixels, own.to(pixels.dtype)])
        grid = own_grid if grid is None else torch.cat([grid, own_grid])
    return pixels, grid, counts


@dataclass(frozen=True)
class PackedLayout:
    """n sequences' real tokens one after another in one row: each prompt without its left
    padding, then its response without its right padding, in sequence order (rl.packing).

    `seq_lens` [n] host ints; `src_T` [T] each row token's flat index in the padded [n, P + R]
    layout; `row_index_nT` [n, P + R] each padded position's place in the row (-1: padding).
    `pack` turns any padded-layout tensor (ids, masks, a router's per-token data) into the row's."""

    seq_lens: list[int]
    src_T: torch.Tensor
    row_index_nT: torch.Tensor

    def to(self, device: torch.device) -> PackedLayout:
        """The same layout with its index tensors on `device` (one built from a host mask: no sync)."""
        return PackedLayout(self.seq_lens, host_to_device(self.src_T, device), host_to_device(self.row_index_nT, device))

    @classmethod
    def of(cls, mask_nT: torch.Tensor) -> PackedLayout:
        real_nT = mask_nT.bool()
        src_T = real_nT.reshape(-1).nonzero()[:, 0]
        row_index_nT = torch.full(real_nT.shape, -1, dtype=torch.long, device=real_nT.device)
        row_index_nT[real_nT] = torch.arange(len(src_T), device=real_nT.device)  # row-major: src_T's order
        return cls(real_nT.sum(1).tolist(), src_T, row_index_nT)

    def pack(self, x_nT: torch.Tensor) -> torch.Tensor:
        """[n, P + R, ...] in the padded layout -> [1, T, ...] in the row's."""
        return x_nT.flatten(0, 1)[self.src_T][None]


def packing_enabled(model, setting: bool | str) -> bool:
    """rl.packing for this model: auto = on where a packed row attends per sample without a dense
    [T, T] mask (sdpa, train/packed_attention.py: varlen kernels on CUDA, per-sample SDPA elsewhere);
    eager / flex_attention would build that mask over the whole row."""
    return per_sample_attention(unwrap(model)) if setting == "auto" else bool(setting)


def _placeholders(host_ids: torch.Tensor, core, feats: ImageFeatures | None, device: torch.device):
    """The image tokens' places in a forward's token rows (their host copy), on `device`; None without images."""
    return None if feats is None else Placeholders.of(host_ids, core.config.image_token_id).to(device)


def _packed_hidden(core, ids_1T: torch.Tensor, host_ids_1T: torch.Tensor, grid: torch.Tensor | None,
                   seq_lens: list[int], feats: ImageFeatures | None, prompt_of_seq: list[int | tuple[int, ...]],
                   keepalive: torch.Tensor | None):
    """Last hidden states [T, H] of a packed row (`ids_1T`, and `host_ids_1T` its host copy, which
    the positions and the image tokens' places are read from); as train.losses.backbone_hidden, but
    with the image features of each prompt (encoded once) gathered into every packed copy of its image
    tokens (forward_shared: the row's image tokens are in sequence order, as the padded batch's are)."""
    mm_1T = (host_ids_1T == core.config.image_token_id).long()
    grid = grid if grid is not None and len(grid) else None
    # M-RoPE restarting per sequence, on the host
    pos_41T = host_to_device(packed_position_ids_host(core.model.get_rope_index, host_ids_1T, mm_1T, grid, seq_lens),
                             ids_1T.device)
    run = functools.partial(forward_shared, core, ids_1T, None, pos_41T, feats, prompt_of_seq, keepalive=keepalive,
                            placeholders=_placeholders(host_ids_1T, core, feats, ids_1T.device))
    if not use_packed_attention(core):  # eager / flash / flex: transformers' own
        return run().last_hidden_state[0]
    rows = PackedRows.of(seq_lens, ids_1T.shape[1], ids_1T.device)
    with packed_forward():
        return run(packed_rows=rows).last_hidden_state[0]


def sequence_logprobs(model, rollout: Rollout, temperature: float, seq_index: list[int] | None = None,
                      with_entropy: bool = False, keep_vision: bool = False, chunk_size: int = 1024,
                      packing: bool = False):
    """Log-probs [n, R] of the generated response tokens of sequences `seq_index` (default all; 0 at
    a multi-turn rollout's tool results, which are read but not scored), recomputed by teacher
    forcing with gradients; the images of the prompts those sequences belong to (only
    those) are encoded once for all their sequences. `keep_vision`: run the vision tower even
    when those prompts have no image (sharded runs: train/sharding.vision_keepalive).
    `packing`: the forward runs on the sequences' real tokens only, one row (PackedLayout), with
    per-sequence M-RoPE and attention; the same numbers as the padded batch, to rounding (tested).
    Returns (logp, entropy or None)."""
    core = unwrap(model)
    host, device = rollout.host, rollout.prompt_ids.device  # the layout below is read from host copies: no syncs
    seq_index = list(range(rollout.response_ids.shape[0])) if seq_index is None else seq_index
    prompt_of = [rollout.prompt_of_seq[n] for n in seq_index]
    needed = sorted(set(prompt_of))  # a mini-batch usually covers a few prompts: encode only theirs
    # multi-turn: the sequences whose tools returned images, each encoded once (after the prompts')
    own = [n for n in seq_index if rollout.images_per_response is not None and rollout.images_per_response[n]]
    pixels, grid_needed, counts = _rollout_images(rollout, needed, own)
    feats = encode_images(core, pixels, grid_needed, counts)
    keepalive = vision_keepalive(model, device) if keep_vision and feats is None else None
    slot = {b: i for i, b in enumerate(needed)}
    own_slot = {n: len(needed) + i for i, n in enumerate(own)}
    # each sequence's image features: its prompt's, then its own tool images' (forward_shared)
    local = [(slot[b], own_slot[n]) if n in own_slot else slot[b] for n, b in zip(seq_index, prompt_of)]
    resp = rollout.response_ids[seq_index]
    ids = torch.cat([rollout.prompt_ids[host_to_device(torch.tensor(prompt_of), device)], resp], dim=1)
    ids_h = torch.cat([host.prompt_ids[prompt_of], host.response_ids[seq_index]], dim=1)
    mask_h = token_mask(rollout, seq_index)
    grid = None
    if grid_needed is not None:  # grids in sequence order (its prompt's, then its tool images'), for M-RoPE
        first = [0, *itertools.accumulate(counts)]
        grid = torch.cat([grid_needed[first[k]:first[k + 1]] for k in feature_groups(local)])
    P, R = rollout.prompt_ids.shape[1], resp.shape[1]
    # the generated response tokens (row, column), in a boolean mask's row-major order; the state
    # before each predicts it: padded position P - 1 + column
    rows_N, cols_N = host.loss_mask[seq_index].bool().nonzero().unbind(1)  # generated tokens (no tool results)
    rows_d, cols_d = host_to_device(torch.stack([rows_N, cols_N]), device)
    if packing:
        layout_h = PackedLayout.of(mask_h)
        hidden_TH = _packed_hidden(core, layout_h.to(device).pack(ids), layout_h.pack(ids_h), grid, layout_h.seq_lens,
                                   feats, local, keepalive)
        hidden_NH = hidden_TH[host_to_device(layout_h.row_index_nT[rows_N, P - 1 + cols_N], device)]
    else:
        pos = rope_positions(core, ids_h, mask_h, core.config.image_token_id, grid, device=device)
        mask = host_to_device(mask_h, device)
        if runs_sdpa(core):
            # the mask transformers' sdpa path builds, without its device check for padding (train/losses.py)
            mask = causal_padding_mask(mask) if not bool(mask_h.all()) else None
        hidden = forward_shared(core, ids, mask, pos, feats, local, keepalive=keepalive,
                                placeholders=_placeholders(ids_h, core, feats, device)).last_hidden_state
        hidden_NH = hidden[rows_d, P - 1 + cols_d]
    # logits only at response tokens, a chunk at a time (train.losses.token_logprobs_entropy); 0 elsewhere
    tokens_N = host_to_device(host.response_ids[seq_index][rows_N, cols_N], device)
    logp_N, entropy_N = token_logprobs_entropy(hidden_NH, core.lm_head, tokens_N, temperature, rollout.banned_ids,
                                               with_entropy, chunk_size)
    # placed by index (a masked_scatter's backward would read the mask on the host)
    logp = logp_N.new_zeros(len(seq_index), R).index_put((rows_d, cols_d), logp_N)
    entropy = entropy_N.new_zeros(len(seq_index), R).index_put((rows_d, cols_d), entropy_N) if with_entropy else None
    return logp, entropy
