"""Token losses computed from hidden states, so logits exist only where a label does, a chunk at a time.

Qwen3-VL's vocabulary is 151,936 wide: materialising [B, T, V] logits for prompt and image tokens
that carry no label wastes most of a step's memory. We run the backbone, gather the positions
whose next token is supervised, and apply lm_head there only; and even those N positions never
hold [N, V] logits at once: `linear_cross_entropy_sum` is our chunked one (or, asked for,
liger-kernel's fused linear cross-entropy on CUDA), and `token_logprobs_entropy` (GRPO) is
chunked. Cross-entropy, log-probs and entropy are fp32 math.

Packed batches (data.packing: one row of several samples, `seq_lens` instead of an attention mask)
get per-sample position ids here (`packed_position_ids`); with sdpa, attention runs per sample
through engine/packed_attention.py (varlen kernels on CUDA), with eager / flash_attention_2 /
flex_attention transformers restricts it from the positions (docs/packing.md, per implementation).
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vlforge.config import ConfigError, LossConfig
from vlforge.data.encode import IGNORE_INDEX
from vlforge.engine.packed_attention import PackedRows, packed_forward, runs_sdpa, use_packed_attention
from vlforge.model.host_inputs import (Placeholders, RopeIndex, VisionGrid, causal_padding_mask, host_to_device,
                                       placeholders_from_host)
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


def backbone_hidden(model, batch: dict) -> torch.Tensor:
    """Last hidden states [B, T, H] of the language model (vision features merged in), of a batch
    from step_inputs (or a plain one, which it goes through first)."""
    core = unwrap(model)
    if "host" not in batch:
        batch = step_inputs(model, batch, batch["input_ids"].device)
    host: HostFacts = batch["host"]
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    # the grids on the host where the tower gets its grid inputs precomputed (it reads the grid there
    # for split sizes only); else (a batch in transformers' video form) where the tower computes them
    device = batch["input_ids"].device
    for key, grid in (("image_grid_thw", host.image_grid_thw), ("video_grid_thw", host.video_grid_thw)):
        if grid is not None:
            inputs[key] = grid if host.vision else host_to_device(grid, device)
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    with contextlib.ExitStack() as stack:
        if host.vision:  # the tower takes them as kwargs; the language model must not get them
            hook = core.model.visual.register_forward_pre_hook(
                lambda module, args, kwargs: (args, {**host.vision, **kwargs}), with_kwargs=True)
            stack.callback(hook.remove)
        if host.placeholders is not None:  # image features and deepstack features placed by index: no syncs
            stack.enter_context(placeholders_from_host(core.model, host.placeholders))
        if host.padding is not None and "position_ids" in inputs and "attention_mask" in inputs and runs_sdpa(core):
            # the mask transformers' sdpa path would build, without its device check for padding (a sync);
            # the attention mask is read only there once the position ids are given
            inputs["attention_mask"] = causal_padding_mask(inputs["attention_mask"]) if host.padding else None
        if host.packed_rows is None:  # padded; or packed with eager / flash / flex
            return core.model(**inputs, use_cache=False).last_hidden_state
        # packed, sdpa: attention per sample (engine/packed_attention.py), no [T, T] mask
        stack.enter_context(packed_forward())
        return core.model(**inputs, use_cache=False, packed_rows=host.packed_rows).last_hidden_state


# ----------------------------------------------------------------------------- lm_head + loss


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def loss_impl_problem(cfg: LossConfig, device: torch.device) -> str | None:
    """Why `loss.impl` cannot run on `device` (None when it can), from the config and the device
    alone: setup_model asks before any weight loads, so a bad choice fails in seconds, not at the
    first step after minutes of loading. (The head needs no check there: no plan wraps lm_head,
    LoRA and FP8 leave it a plain bias-free nn.Linear; resolve_loss_impl still checks it.)"""
    if cfg.impl != "liger":
        return None
    if not liger_available():
        return ("loss.impl=liger: liger-kernel is not installed; pip install 'vlforge[liger]' or set loss.impl=auto "
                "(ours, chunked)")
    if device.type != "cuda":
        return (f"loss.impl=liger needs CUDA (liger-kernel's fused op is Triton kernels), but the run's device is "
                f"{device}; set loss.impl=auto or chunked")
    return None


def resolve_loss_impl(impl: str, lm_head: torch.nn.Module, device: torch.device) -> str:
    """"plain", "chunked" or "liger" for loss.impl on this device and head.

    liger's fused op takes the weight matrix itself, so only a plain nn.Linear head without bias
    (not an FP8 or LoRA-wrapped one) and only on CUDA (Triton kernels)."""
    fits = device.type == "cuda" and type(lm_head) is torch.nn.Linear and lm_head.bias is None
    if impl == "liger":
        if problem := loss_impl_problem(LossConfig(impl="liger"), device):
            raise ConfigError(problem)
        if not fits:
            raise ConfigError(f"loss.impl=liger needs a plain bias-free lm_head (got {type(lm_head).__name__}); "
                              "use loss.impl=auto or chunked")
        return "liger"
    if impl == "auto":  # ours: at least as fast as liger's on the H200 (config.LossConfig)
        return "chunked"
    return impl


def _ce_sum(lm_head, hidden_NH: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(lm_head(hidden_NH).float(), targets_N, reduction="sum")


def liger_chunk_mem_const(positions: int, hidden: int, vocab: int, chunk_size: int) -> int:
    """liger's `chunk_mem_const` C that makes its chunks about `chunk_size` positions (it takes
    next_pow2(ceil(N / ceil(V / (C H)))) positions a chunk). Its default C=1 bounds the logits
    to the size of the hidden states: 64 positions a chunk at the 2B shapes, and each chunk then
    adds its [V, H] weight gradient into the fp32 accumulator (2.5 GB of traffic a chunk: 62 ms of
    a 310 ms step in the H200 profile, docs/benchmarks.md); ~1024 positions a chunk cut that 16x."""
    return max(1, -(-vocab // (hidden * -(-positions // chunk_size))))  # ceil: at most that many chunks


def linear_cross_entropy_sum(hidden_NH: torch.Tensor, lm_head: torch.nn.Module, targets_N: torch.Tensor,
                             impl: str = "auto", chunk_size: int = 1024) -> torch.Tensor:
    """sum_n CE(lm_head(hidden_NH[n]), targets_N[n]), fp32 scalar; every target is a real label.

    plain: [N, V] logits at once (the reference). chunked: chunk_size positions at a time, each
    chunk under activation checkpointing, so neither forward nor backward holds more than
    [chunk_size, V] logits (backward recomputes a chunk's logits: one more lm_head matmul, a few
    ms per step; torch has no fused linear+CE of its own). liger: liger-kernel's fused op, which
    computes the gradients chunk by chunk in its forward (fp32 accumulation), here chunk_size
    positions at a time too (`liger_chunk_mem_const`)."""
    impl = resolve_loss_impl(impl, lm_head, hidden_NH.device)
    if impl == "plain" or len(targets_N) == 0:  # an empty chunk list would leave no graph to backward through
        return _ce_sum(lm_head, hidden_NH, targets_N)
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden_NH, lm_head.weight, targets_N, ignore_index=IGNORE_INDEX,
                                                reduction="sum", accum_dtype=torch.float32,
                                                chunk_mem_const=liger_chunk_mem_const(*hidden_NH.shape,
                                                                                      len(lm_head.weight),
                                                                                      chunk_size)).float()
    grad = torch.is_grad_enabled()
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for s in range(0, len(targets_N), chunk_size):
        args = (lm_head, hidden_NH[s:s + chunk_size], targets_N[s:s + chunk_size])
        total = total + (checkpoint(_ce_sum, *args, use_reentrant=False, preserve_rng_state=False) if grad
                         else _ce_sum(*args))
    return total


def _logprob_chunk(lm_head, hidden_NH, tokens_N, temperature, banned_N, with_entropy):
    logits_NV = lm_head(hidden_NH).float() / temperature
    if banned_N is not None:
        logits_NV = logits_NV.index_fill(-1, banned_N, float("-inf"))
    logp_all_NV = F.log_softmax(logits_NV, dim=-1)
    logp_N = logp_all_NV.gather(-1, tokens_N[:, None])[:, 0]
    if not with_entropy:
        return logp_N, None
    with torch.no_grad():  # entropy is reported, never differentiated
        entropy_N = -(logp_all_NV.exp() * logp_all_NV.nan_to_num(neginf=0.0)).sum(-1)
    return logp_N, entropy_N


def token_logprobs_entropy(hidden_NH: torch.Tensor, lm_head: torch.nn.Module, tokens_N: torch.Tensor,
                           temperature: float = 1.0, banned_ids: list[int] | None = None, with_entropy: bool = False,
                           chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(tokens_N[n]) [N], entropy [N] (detached) or None) under softmax(lm_head(hidden_NH) / T)
    with `banned_ids` at -inf (the rollout never samples them, so the trainer's policy excludes them
    too), fp32. Chunked like linear_cross_entropy_sum: at most [chunk_size, V] logits in forward and
    backward. (liger's fused op cannot ban vocabulary entries nor return the entropy.)"""
    banned_N = host_to_device(torch.tensor(banned_ids), hidden_NH.device) if banned_ids else None
    grad = torch.is_grad_enabled()
    logps, entropies = [], []
    for s in range(0, max(len(tokens_N), 1), chunk_size):
        args = (lm_head, hidden_NH[s:s + chunk_size], tokens_N[s:s + chunk_size], temperature, banned_N, with_entropy)
        logp, entropy = (checkpoint(_logprob_chunk, *args, use_reentrant=False, preserve_rng_state=False) if grad
                         else _logprob_chunk(*args))
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), (torch.cat(entropies).detach() if with_entropy else None)


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


def sft_loss_sum(model, batch: dict, keep_vision: bool = False, loss: LossConfig = LossConfig()
                 ) -> tuple[torch.Tensor, int]:
    """(sum of next-token cross-entropy over supervised tokens, number of supervised tokens), for a
    padded batch or a packed row alike (`pack` ignores each sample's first label, so no position
    predicts across a sample boundary). `loss`: how lm_head + cross-entropy run (LossConfig).
    `keep_vision`: run the vision tower even on a batch without images (vision_keepalive), first,
    where a batch with images runs it too: sharded, every rank then gathers the same units in the
    same order."""
    if "host" not in batch:  # a plain batch: what step_inputs reads, read where it is
        batch = step_inputs(model, batch, batch["input_ids"].device)
    if keep_vision and batch.get("pixel_values") is None and batch.get("pixel_values_videos") is None:
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
    # the supervised positions, found on the host (step_inputs): boolean-mask indexing here would
    # run a nonzero on the device, a sync, twice
    hidden_NH = hidden_BTH[:, :-1][batch["label_rows"], batch["label_cols"]]
    loss_sum = linear_cross_entropy_sum(hidden_NH, unwrap(model).lm_head, batch["label_targets"], loss.impl,
                                        loss.chunk_size)
    return loss_sum, batch["host"].supervised


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
