"""Activation memory of a training step: the bytes a forward keeps for its backward, from the
model's shapes, the config and the tokens of a micro-batch. Pure arithmetic; `--plan` shows it
beside memory.py's estimate, and `activation_checkpointing.enabled: auto` chooses from it
(train/recompute.py).

    est = activation_estimate(model.config, cfg, tokens=16384, every=0)   # every: 0 none, N 1 of every N
    est["total"]                                                           # bytes

Per block and token (`block_bytes`): coefficients fitted on CPU, counting every tensor autograd
saves (torch.autograd.graph.saved_tensors_hooks, each storage once) in Qwen3-VL decoder layers of
the 2B and 8B shapes under bf16 autocast, full (fp32 masters) and frozen bf16 with peft LoRA
(docs/training.md, memory; `python bench/activations.py`): within 1% of the count on those shapes.
The eager count: compiled layers keep less (Inductor fuses the elementwise ops), so the estimate is
an upper bound for them.
A recomputed block (activation checkpointing) keeps only its input; backward recomputes one block
at a time, whose activations are then held once more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Bytes kept per token and unit of width (fitted, see above): the residual stream's hidden units
# (norm inputs and outputs, attention's q/k/v/out in and out) in the residual dtype; the MLP's
# intermediate units in the compute dtype (3 values: gate, up and the activation's output; 4 when
# the MLP's weights train, whose down projection then keeps its input too); the key/value heads' units.
RESIDUAL_PER_HIDDEN = 9
COMPUTE_PER_INTERMEDIATE = 3
COMPUTE_PER_KV = 5
# A LoRA adapter keeps its input for the adapter's weight gradient (~1.5 bytes per input feature
# measured with the base frozen in bf16) and, with dropout, the dropped copy and its mask (+4).
LORA_PER_INPUT = 1.5
LORA_DROPOUT_PER_INPUT = 4.0


# activation checkpointing's notches: 0 nothing recomputed; N: 1 of every N decoder layers and vision
# blocks (1: every block). One notch sheds about half of what the blocks keep for backward (4 -> 2 -> 1).
NOTCHES = (0, 4, 2, 1)


def describe(every: int) -> str:
    return {0: "nothing recomputed", 1: "every block recomputed"}.get(every, f"1 of every {every} blocks recomputed")


@dataclass(frozen=True)
class Stack:
    """A stack of blocks as the estimate sees it: the shapes of one block, and which blocks keep
    activations for backward (those from `first` on: below the first block whose output needs a
    gradient, a frozen stack's blocks keep nothing)."""

    depth: int
    first: int  # the first block that keeps activations (depth: none)
    hidden: int
    intermediate: int
    kv: int  # key/value heads x head dim (the hidden size without grouped-query attention)
    lora_inputs: int = 0  # the input features of one block's LoRA-adapted linears, summed
    lora_dropout: bool = False
    weights_train: bool = False  # full fine-tuning of its weights


def block_bytes(s: Stack, residual_bytes: int, compute_bytes: int) -> float:
    """Bytes one block keeps for backward per token (per patch for a vision block)."""
    mlp = COMPUTE_PER_INTERMEDIATE + (1 if s.weights_train else 0)
    lora = s.lora_inputs * (LORA_PER_INPUT + (LORA_DROPOUT_PER_INPUT if s.lora_dropout else 0.0))
    return (RESIDUAL_PER_HIDDEN * residual_bytes * s.hidden + mlp * compute_bytes * s.intermediate
            + COMPUTE_PER_KV * compute_bytes * s.kv + lora)


def stack_bytes(s: Stack, tokens: int, every: int, residual_bytes: int, compute_bytes: int) -> float:
    """Bytes a stack keeps for backward over `tokens` tokens: every kept block's activations, or
    for a block that activation checkpointing recomputes (every > 0: the blocks i % every == 0, as
    train/trainable.checkpoint_selected_blocks picks them) its input only, plus one recomputed
    block's activations while backward recomputes it."""
    per_block = block_bytes(s, residual_bytes, compute_bytes) * tokens
    blocks = range(s.first, s.depth)
    recomputed = [i for i in blocks if every and i % every == 0]
    kept = len(blocks) - len(recomputed)
    inputs = len(recomputed) * residual_bytes * s.hidden * tokens
    return kept * per_block + inputs + (per_block if recomputed else 0.0)


def stacks(config, cfg) -> tuple[Stack, Stack]:
    """(language, vision) stacks of a Qwen3-VL config (`model.config`) under `cfg`'s tiers. The
    language layers keep activations whenever anything trains (the loss is above them); the vision
    blocks from the first trainable one on (tiers.vision.last_n_blocks). MoE layers count the routed
    experts' width (top-k x the expert width) as the MLP's."""
    text, vision, tiers = config.text_config, config.vision_config, cfg.tiers
    lora = tiers.method == "lora"
    heads_dim = text.num_attention_heads * text.head_dim
    kv = text.num_key_value_heads * text.head_dim
    experts = getattr(text, "num_experts", 0)
    width = text.moe_intermediate_size * text.num_experts_per_tok if experts else text.intermediate_size
    lang = tiers.language
    lora_in = 0
    if lora and lang.train:  # q, k, v read the hidden state, o the heads' output; mlp: gate, up and down
        lora_in = 3 * text.hidden_size + heads_dim + ((2 * text.hidden_size + width) if lang.mlp else 0)
    language = Stack(text.num_hidden_layers, 0, text.hidden_size, width, kv, lora_in, lang.dropout > 0,
                     not lora and lang.train)
    vt = tiers.vision
    first = vision.depth if not vt.train else max(0, vision.depth - (vt.last_n_blocks or vision.depth))
    v_lora = (3 * vision.hidden_size + vision.hidden_size + ((vision.hidden_size + vision.intermediate_size)
                                                            if vt.mlp else 0)) if lora and vt.train else 0
    tower = Stack(vision.depth, first, vision.hidden_size, vision.intermediate_size, vision.hidden_size, v_lora,
                  vt.dropout > 0, not lora and vt.train)
    return language, tower


def loss_bytes(cfg, tokens: int, vocab: int) -> float:
    """The loss's logits (fp32) and their gradient: a chunk of loss.chunk_size label positions at a
    time (chunked, auto; liger's chunks alike), every position at once (plain)."""
    positions = tokens if cfg.loss.impl == "plain" else min(tokens, cfg.loss.chunk_size)
    return 2.0 * 4 * positions * vocab


def activation_estimate(config, cfg, tokens: int, every: int) -> dict:
    """Bytes a micro-batch of `tokens` tokens keeps for backward under `cfg` (a RunConfig) with
    activation checkpointing recomputing nothing (every=0) or 1 of every `every` blocks. The vision
    tower's patches are counted as if every token were an image token (merge**2 patches each): an
    upper bound, as the tokens are. JSON-able."""
    from vlforge.train.precision import PrecisionPolicy

    policy = PrecisionPolicy(cfg.precision, "cpu")
    compute = policy.compute_dtype.itemsize
    language, tower = stacks(config, cfg)
    # the residual stream runs in the dtype of what it is summed with: fp32 masters of a full tier
    lang_residual = policy.master_dtype.itemsize if language.weights_train else compute
    tower_residual = policy.master_dtype.itemsize if tower.weights_train else compute
    patches = tokens * config.vision_config.spatial_merge_size ** 2
    parts = {"language": stack_bytes(language, tokens, every, lang_residual, compute),
             "vision": stack_bytes(tower, patches, every, tower_residual, compute),
             "loss": loss_bytes(cfg, tokens, config.text_config.vocab_size)}
    return {"tokens": tokens, "every": every, **parts, "total": math.fsum(parts.values())}


def plan_tokens(cfg) -> int:
    """The tokens of the longest micro-batch a config allows, for `--plan` (no data read): SFT
    data.max_tokens_per_batch, else batch_size rows of data.max_length; GRPO rl.mini_batch_size
    sequences of the prompt and rollout.max_new_tokens. A run counts its data's instead
    (train/recompute.longest_micro_batch)."""
    if hasattr(cfg, "rollout"):
        return cfg.rl.mini_batch_size * (cfg.data.max_length + cfg.rollout.max_new_tokens)
    budget = getattr(cfg.data, "max_tokens_per_batch", None)
    return budget or cfg.train.batch_size * cfg.data.max_length
