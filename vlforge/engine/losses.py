"""Token losses computed from hidden states, so logits exist only where a label does.

Qwen3-VL's vocabulary is 151,936 wide: materialising [B, T, V] logits for prompt and image tokens
that carry no label wastes most of a step's memory. We run the backbone, gather the positions
whose next token is supervised, and apply lm_head there only. Cross-entropy is in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlforge.data.encode import IGNORE_INDEX
from vlforge.model.tiers import unwrap

MODEL_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")


def backbone_hidden(model, batch: dict) -> torch.Tensor:
    """Last hidden states [B, T, H] of the language model (vision features merged in)."""
    core = unwrap(model)
    out = core.model(**{k: batch[k] for k in MODEL_INPUTS if k in batch}, use_cache=False)
    return out.last_hidden_state


def sft_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropy over supervised tokens, number of supervised tokens)."""
    hidden_BTH = backbone_hidden(model, batch)
    targets_BT = batch["labels"][:, 1:]
    supervised_BT = targets_BT != IGNORE_INDEX
    hidden_NH = hidden_BTH[:, :-1][supervised_BT]
    logits_NV = unwrap(model).lm_head(hidden_NH).float()
    loss = F.cross_entropy(logits_NV, targets_BT[supervised_BT], reduction="sum")
    return loss, int(supervised_BT.sum())


def count_supervised(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
