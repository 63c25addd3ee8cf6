"""A training step's inputs, prepared on the host from the batch's CPU copy before it moves: the
supervised positions and counts, M-RoPE position ids, the vision tower's grid inputs and a packed
row's sequences (HostPrep runs in the loader's worker processes; step_inputs on the main thread when
a batch comes without them). Why the host: docs/architecture.md, "A training step reads nothing back
from the GPU but its metrics".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlforge.data.encode import IGNORE_INDEX
from vlforge.train.packed_attention import PackedRows, use_packed_attention
from vlforge.model.host_inputs import (Placeholders, RopeIndex, VisionGrid, host_to_device)
from vlforge.model.tiers import unwrap

MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "pixel_values_videos")


def packed_position_ids(core, input_ids_1T: torch.Tensor, mm_token_type_ids_1T: torch.Tensor,
                        image_grid_thw: torch.Tensor | None, seq_lens: list[int],
                        video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [4, 1, T] of a packed row on its device: [text positions; t; h; w], Qwen3-VL's
    4-row form (packed_position_ids_host says how)."""
    return host_to_device(packed_position_ids_host(core.model.get_rope_index, input_ids_1T, mm_token_type_ids_1T,
                                                   image_grid_thw, seq_lens, video_grid_thw), input_ids_1T.device)


def packed_position_ids_host(rope_index, input_ids_1T: torch.Tensor, mm_token_type_ids_1T: torch.Tensor,
                             image_grid_thw: torch.Tensor | None, seq_lens: list[int],
                             video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """Position ids [4, 1, T] of a packed row, on the CPU: [text positions; t; h; w].

    M-RoPE (rows 1-3) comes from the model's own get_rope_index (`rope_index`: the bound method, or
    a RopeIndex) over the samples as separate rows, so every sample's positions, its images' 3-D
    ones included, restart at 0 exactly as when the sample is alone; the image grids are taken in
    order, one sample after the other, as in the row (and so are the video grids). Row 0 (text positions, 0..len-1 per sample)
    is what transformers reads for the attention mask: with no 2-D attention mask, a position that
    does not follow its predecessor starts a new sequence (masking_utils.find_packed_sequence_indices;
    flash-attention's varlen path reads the same row). The filler after the last sample (`pack`'s
    `multiple`/`pad_to`) is one more sequence.
    """
    # On the CPU: get_rope_index walks each sample's token groups in Python (.tolist(), per-image
    # aranges), which on the GPU would be a sync and a few tiny kernels per sample.
    T = input_ids_1T.shape[1]
    S = int(sum(seq_lens))
    mask_nL = torch.arange(max(seq_lens))[None] < torch.tensor(seq_lens)[:, None]
    ids_nL = torch.zeros(mask_nL.shape, dtype=torch.long).masked_scatter(mask_nL, input_ids_1T[0, :S].cpu().long())
    mm_nL = torch.zeros_like(ids_nL).masked_scatter(mask_nL, mm_token_type_ids_1T[0, :S].cpu().long())
    grid = image_grid_thw.cpu() if image_grid_thw is not None else None
    videos = video_grid_thw.cpu() if video_grid_thw is not None else None
    mrope_3nL, _ = rope_index(ids_nL, mm_nL, image_grid_thw=grid, video_grid_thw=videos, attention_mask=mask_nL.long())
    text_S = torch.arange(mask_nL.shape[1]).expand_as(mask_nL)[mask_nL]
    filler = torch.arange(T - S)
    text_T = torch.cat([text_S, filler])
    mrope_3T = torch.cat([mrope_3nL[:, mask_nL], filler.expand(3, -1)], dim=1)
    return torch.cat([text_T[None], mrope_3T])[:, None]


# A dataclass: FSDP2's and DDP's input move (torch.distributed.utils._recursive_to) enters dicts and
# tuples, not dataclasses, so the host tensors stay on the host. (FSDP2's mixed-precision input cast
# does enter it: the vision kwargs' float interpolation weights become the param dtype, as the tower's
# weights are under FSDP2.)
@dataclass(frozen=True, eq=False)
class HostFacts:
    """What a step's forward and loss read on the host, computed from the batch's CPU copy before it
    moves (step_inputs): on the GPU each such read would stall the CPU until the queue drains."""

    supervised: int  # supervised tokens (the loss's count)
    image_grid_thw: torch.Tensor | None  # on the host: transformers reads it there (split sizes)
    vision: dict  # the vision tower's precomputed kwargs (transformers.vision_utils), or {}
    packed_rows: PackedRows | None = None  # packed rows with per-sample attention (sdpa)
    placeholders: Placeholders | None = None  # where the image tokens are (a batch with images, no video)
    padding: bool | None = None  # whether any row of a padded batch has padding (None: not known)
    video_grid_thw: torch.Tensor | None = None  # on the host, as image_grid_thw


@dataclass(frozen=True)
class HostPrep:
    """What a step reads on the host, computed from a batch's CPU copy: `prep(batch)` is the batch
    plus "host_inputs" (the supervised positions and their targets, M-RoPE position ids, the vision
    tower's grid inputs, the supervised count), all on the CPU. A picklable callable of config
    values only (HostPrep.of(model)), so the recipe's DataLoader runs it in its worker processes
    at collate time, and its pin_memory pins the result: the step then only queues non-blocking
    copies (step_inputs), and this work runs while the GPU computes earlier steps. With
    data.num_workers=0 the loader calls it on the main thread, before the step, as step_inputs
    would: the workers are what take it off the step's critical path."""

    rope_index: RopeIndex
    vision: VisionGrid | None
    image_token_id: int

    @classmethod
    def of(cls, model) -> HostPrep:
        core = unwrap(model).model  # the Qwen3-VL model (language model + vision tower)
        return cls(RopeIndex.of(core), VisionGrid.of(core.visual), core.config.image_token_id)

    def __call__(self, batch: dict) -> dict:
        targets_BT = batch["labels"][:, 1:]
        rows_N, cols_N = (targets_BT != IGNORE_INDEX).nonzero().unbind(1)  # what boolean-mask indexing computes
        grid = batch.get("image_grid_thw")
        grid = grid.cpu() if grid is not None else None  # transformers reads it on the host (split sizes)
        videos = batch.get("video_grid_thw")
        videos = videos.cpu() if videos is not None else None
        facts = {"label_rows": rows_N, "label_cols": cols_N, "label_targets": targets_BT[rows_N, cols_N],
                 "supervised": len(rows_N), "image_grid_thw": grid, "video_grid_thw": videos, "vision": {},
                 "vision_host": {}}
        # a packed batch whose rows were all skipped (data.on_error=skip) has no samples: the step leaves it out
        if "seq_lens" in batch and len(batch["seq_lens"]):
            facts["position_ids"] = packed_position_ids_host(self.rope_index, batch["input_ids"],
                                                             batch["mm_token_type_ids"], grid,
                                                             batch["seq_lens"].tolist(), videos)
        elif grid is not None or videos is not None:  # what the model's forward would compute, here
            facts["position_ids"], _ = self.rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                       image_grid_thw=grid, video_grid_thw=videos,
                                                       attention_mask=batch.get("attention_mask"))
        # With a video the tower runs twice (images, then videos: transformers' two calls), so the
        # precomputed grid kwargs of one call would reach the other: such a batch lets the tower and
        # the model compute them (and find the placeholders) themselves.
        if grid is not None and videos is None:
            if self.vision is not None:
                facts["vision"], facts["vision_host"] = self.vision(grid)
            facts["placeholders"] = Placeholders.of(batch["input_ids"], self.image_token_id)
        if "attention_mask" in batch and "seq_lens" not in batch:
            facts["padding"] = not bool(batch["attention_mask"].all())
        return {**batch, "host_inputs": facts}


def step_inputs(model, batch: dict, device: torch.device) -> dict:
    """`batch` on `device`, with what its forward and loss need computed where the batch is (the
    training step passes the CPU copy, so none of it syncs with the GPU): the supervised positions
    and their targets (`label_rows`, `label_cols`, `label_targets`), M-RoPE position ids (packed:
    per sample; padded with images: the model's own get_rope_index, which otherwise runs on the
    device), the vision tower's grid inputs, and `host` (HostFacts). The values are the ones the
    model would compute itself, so results are bit-identical. A batch from HostPrep (the recipe's
    loader workers) has them already: then this only queues copies of pinned memory."""
    core = unwrap(model)
    if "host_inputs" not in batch:  # not prepared where batches are made: here, as the loader would
        batch = HostPrep.of(model)(batch)
    facts = batch["host_inputs"]
    out = {k: v for k, v in batch.items() if k not in ("image_grid_thw", "video_grid_thw", "host_inputs")}
    out.update({k: facts[k] for k in ("label_rows", "label_cols", "label_targets", "position_ids") if k in facts})
    out = {k: host_to_device(v, device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    packed_rows = None
    if "seq_lens" in batch and use_packed_attention(core):  # the row's sequences computed once here, for every layer
        packed_rows = PackedRows.of(batch["seq_lens"].tolist(), batch["input_ids"].shape[1], device)
    vision = VisionGrid.moved(facts["vision"], facts["vision_host"], device)
    placeholders = facts["placeholders"].to(device) if facts.get("placeholders") is not None else None
    out["host"] = HostFacts(facts["supervised"], facts["image_grid_thw"], vision, packed_rows, placeholders,
                            facts.get("padding"), facts.get("video_grid_thw"))
    return out


def count_supervised(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def count_tokens(batch: dict) -> int:
    """Real tokens of a batch: padding and a packed row's filler not counted."""
    return int(batch["seq_lens"].sum()) if "seq_lens" in batch else int(batch["attention_mask"].sum())


def real_tokens(batch: dict) -> torch.Tensor:
    """[B, T] 1 on a batch's real tokens (the attention mask; a packed row: all but its filler tail)."""
    if "seq_lens" not in batch:
        return batch["attention_mask"]
    T = batch["input_ids"].shape[1]
    return (torch.arange(T, device=batch["input_ids"].device) < batch["seq_lens"].sum())[None].long()
