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


def vision_keepalive(model, device: torch.device) -> torch.Tensor:
    """0 x the vision tower's output on one blank image (its smallest grid), with a graph to every
    vision parameter. A rank whose micro-batch has no image runs it: sharded (FSDP2), the vision
    tower's all-gathers and gradient reduce-scatters are collectives every rank must join, so
    skipping the tower on one rank would hang the others. It changes neither the loss nor any
    gradient (its gradients are exact zeros)."""
    visual = unwrap(model).model.visual
    cfg = visual.config
    m = cfg.spatial_merge_size
    pixels = torch.zeros(m * m, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2, device=device,
                         dtype=next(visual.parameters()).dtype)
    out = visual(pixels, grid_thw=torch.tensor([[1, m, m]], device=device))
    return 0.0 * (out.pooler_output.float().sum() + sum(f.float().sum() for f in out.deepstack_features))


def drop_keepalive_grads(model) -> None:
    """For an optimizer step whose global batch had no image at all: the vision tower's gradients
    are the keep-alive's zeros; None instead, as one process leaves them, so AdamW skips those
    parameters (a zero gradient would still move them by momentum and weight decay)."""
    for p in unwrap(model).model.visual.parameters():
        p.grad = None


def sft_loss_sum(model, batch: dict, keep_vision: bool = False) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropy over supervised tokens, number of supervised tokens).
    `keep_vision`: run the vision tower even on a batch without images (vision_keepalive), first,
    where a batch with images runs it too: sharded, every rank then gathers the same units in the
    same order."""
    if keep_vision and batch.get("pixel_values") is None:
        keepalive = vision_keepalive(model, batch["input_ids"].device)
        # joined to the token embeddings, where a batch's image features join: the first decoder
        # layer's input then needs a gradient exactly when it does on ranks with images (FSDP2
        # orders a unit's gradient reduction by that), and the loss and every gradient stay the same
        embed = unwrap(model).model.get_input_embeddings()
        hook = embed.register_forward_hook(lambda module, args, out: out + keepalive.to(out.dtype))
        try:
            hidden_BTH = backbone_hidden(model, batch)
        finally:
            hook.remove()
    else:
        hidden_BTH = backbone_hidden(model, batch)
    targets_BT = batch["labels"][:, 1:]
    supervised_BT = targets_BT != IGNORE_INDEX
    hidden_NH = hidden_BTH[:, :-1][supervised_BT]
    logits_NV = unwrap(model).lm_head(hidden_NH).float()
    loss = F.cross_entropy(logits_NV, targets_BT[supervised_BT], reduction="sum")
    return loss, int(supervised_BT.sum())


def count_supervised(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


class Root(torch.nn.Module):
    """`Root(model)(fn, *args)` is `fn(model, *args)`: a training step's forward as one module.

    Sharded (FSDP2), this is the root unit: the embeddings, final norm and lm_head are gathered
    when its forward starts and their gradients reduced after its backward. The recipes call the
    backbone and lm_head themselves (logits only where labels are; shared image features in GRPO),
    which bypasses the HF model's own forward, so the root must be a module the step does enter.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(self.model, *args, **kwargs)
