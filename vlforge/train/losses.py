"""Token losses computed from hidden states, so logits exist only where a label does, a chunk at a time.

Qwen3-VL's vocabulary is 151,936 wide: materialising [B, T, V] logits for prompt and image tokens
that carry no label wastes most of a step's memory. We run the backbone, gather the positions
whose next token is supervised, and apply lm_head there only; and even those N positions never
hold [N, V] logits at once: `linear_cross_entropy_sum` is our chunked one (or, asked for,
liger-kernel's fused linear cross-entropy on CUDA), and `token_logprobs_entropy` (GRPO) is
chunked. Cross-entropy, log-probs and entropy are fp32 math.

Packed batches (data.packing: one row of several samples, `seq_lens` instead of an attention mask)
get per-sample position ids here (`packed_position_ids`); with sdpa, attention runs per sample
through train/packed_attention.py (varlen kernels on CUDA), with eager / flash_attention_2 /
flex_attention transformers restricts it from the positions (docs/packing.md, per implementation).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vlforge.config import ConfigError, LossConfig
from vlforge.data.encode import IGNORE_INDEX
from vlforge.train.packed_attention import packed_forward, runs_sdpa
from vlforge.model.host_inputs import (causal_padding_mask, host_to_device,
                                       placeholders_from_host)
from vlforge.model.tiers import unwrap

from vlforge.train.inputs import MODEL_INPUTS, HostFacts, step_inputs
from vlforge.train.sharding import vision_keepalive


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
        # packed, sdpa: attention per sample (train/packed_attention.py), no [T, T] mask
        stack.enter_context(packed_forward())
        return core.model(**inputs, use_cache=False, packed_rows=host.packed_rows).last_hidden_state


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
