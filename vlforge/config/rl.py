"""GRPO's sections: the rollouts (`rollout`), their tools (`tools`), and the RL objective with its
rewards (`rl`). rollout/, rl/ and recipes/grpo.py apply them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .load import ConfigError, _range, _require


@dataclass
class RolloutConfig:
    """GRPO's sampling of G responses per prompt on the generation engine (generate/; rollout/)."""

    group_size: int = 8  # G responses per prompt
    prompts_per_step: int = 8  # B prompts per optimizer step (before dynamic-sampling refills)
    temperature: float = 1.0  # sampling temperature (0 = greedy; GRPO needs varied responses per group)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256  # the response length cap
    # torch.compile the decode step (on CUDA): once per run, then ~1.9x faster
    # decoding (docs/benchmarks.md); off: CUDA graphs of the eager layers
    compile: bool = True
    # Keep the engine's KV slots (and decode CUDA graphs) from one step's rollouts to the next, or
    # free them once the rollouts are done so the update can use that memory: layers x 2 x slots x
    # KV length x KV heads x head dim x 2 bytes (8B, 64 slots x 1024 tokens: 9.7 GB). Freeing costs,
    # every step, the allocation and, on one GPU, capturing each decode graph again (one per slot /
    # KV-length bucket reached; docs/benchmarks.md: 3 graphs in 1.7 s with eager layers, 0.3 s for a
    # compiled step's). The compiled step itself is kept and does not recompile for new buffers of
    # another length (their length is a dynamic dimension; tested). Several processes capture no
    # graphs, so there freeing costs only the allocation. Kept by default: the buffers serve every
    # step; free them when the update runs out of memory.
    keep_kv: bool = True
    # Decode slots: 0 = every sample of a round at once (the KV memory of all of
    # them); N = at most N samples decode together and the others wait, a prompt's G samples
    # joining as soon as G slots are free (continuous batching: a group of short answers frees its
    # slots for the next prompt, and the KV slots' memory is N rows). Same tokens either way (each
    # sample's randomness is its own row's, generate/sampling.py). At least group_size.
    max_slots: int = 0
    # MoE models (docs/moe.md): the rollout records every token's top-k experts per layer and the
    # trainer logs moe/route_flip (how often its own choice differs); true: the trainer's forwards
    # (and the KL reference's) also use the recorded experts ("router replay", R3); record: measure only.
    # Off by default: replay makes the trainer run experts its router would not pick (and routes its
    # gradient through them); turn it on when moe/route_flip and the ratio's spread say the mismatch matters
    router_replay: bool | Literal["record"] = False
    # The weights the rollouts decode (and prefill) with: bf16 (the policy's own, in the compute dtype)
    # or fp8 (FP8 copies of the decoder layers' projections, per-channel weight scales and per-token
    # activation scales, made again from the trained weights before each step's rollouts: the time that
    # takes is rollout/fp8_refresh_s; LoRA adapters merged into the copies; vision tower, embeddings,
    # lm_head and MoE experts as bf16). Its log-probs differ more from the trainer's: pair it with
    # rl.old_logprobs=trainer and rl.rollout_correction (docs/grpo.md, FP8 rollouts). bf16 by default:
    # fp8 is faster (H100: 1.35x at 8B LoRA, 1.10x at 2B full) but its log-probs depart ~90x further
    # from the trainer's (k3 KL 9.8e-2 vs 1.1e-3 at 8B, docs/benchmarks.md, GRPO), which changes what
    # GRPO optimizes unless corrected: a choice made together with rl.rollout_correction
    precision: Literal["bf16", "fp8"] = "bf16"

    def __post_init__(self):
        _range(self, "group_size", ge=2, why="advantages compare responses within a group")
        _range(self, "prompts_per_step", ge=1)
        _range(self, "temperature", ge=0, why="0 = greedy")
        _range(self, "top_p", gt=0, le=1)
        _range(self, "top_k", ge=0, why="0 = off")
        _range(self, "max_new_tokens", ge=1)
        _range(self, "max_slots", ge=0, why="0 = every sample at once")
        if 0 < self.max_slots < self.group_size:
            raise ConfigError(f"rollout.max_slots={self.max_slots} is below rollout.group_size={self.group_size}: "
                              "a prompt's samples decode together (they share its prefill); raise it or set 0")


@dataclass
class ToolsConfig:
    """Multi-turn tool rollouts (rollout/multiturn.py; docs/grpo.md, tools): which tools, how many
    turns, how their results are bounded and where their calls run. GRPO's, and `vlforge eval --tool`'s."""

    # The tools the model may call: builtins (calculator, zoom_in) or path/to/file.py:function (type
    # hints + a docstring with Args: its schema). The chat template lists them in the prompt; an
    # assistant turn with <tool_call> blocks gets their results back as a tool message and the rollout
    # continues. Results and headers are read, not trained. Empty: single-turn rollouts.
    names: list[str] = field(default_factory=list)
    turns: int = 4  # assistant turns whose tool calls run, at most; a later turn's calls end the response
    result_tokens: int = 256  # each tool result's text cut to this many tokens
    # each tool result's text cut to this many characters first, where the call returns (a note the model
    # reads first, and a warning): a tool that returns megabytes costs neither memory nor tokenizer time
    result_chars: int = 65536
    # a tool's returned images are resized to at most this many pixels (256 tokens at Qwen3-VL's 32x32
    # pixels a token; data.min_pixels..max_pixels apply to the prompt's images): their tokens count
    # toward max_new_tokens, and an image at data.max_pixels (1024 tokens) would rarely fit
    image_max_pixels: int = 256 * 32 * 32
    timeout_s: float = 30.0  # a round of tool calls (all sequences' at once) waits this long for them
    # 0: each call on a thread of the trainer's process; N > 0: in up to N worker processes, where a
    # call past timeout_s is stopped (for tools that may hang, hold the GIL or crash)
    processes: int = 0

    def __post_init__(self):
        _range(self, "turns", ge=1)
        _range(self, "result_tokens", ge=1)
        _range(self, "result_chars", ge=1)
        _range(self, "image_max_pixels", ge=1024)
        _range(self, "timeout_s", gt=0)
        _range(self, "processes", ge=0)


@dataclass
class RewardConfig:
    name: str = "exact_match"  # builtin (exact_match, choice, numeric, format) or path/to/file.py:function
    weight: float = 1.0  # may be negative: a penalty
    kwargs: dict = field(default_factory=dict)  # passed to the reward function (e.g. a judge's model and prompt)

    def __post_init__(self):
        _range(self, "weight")


# Each policy loss's (clip_low, clip_high) when the config leaves them null: PPO's usual 0.2; GSPO's paper
# (v2, section 5.1); CISPO without lower truncation, as MiniMax-M1
LOSS_CLIP_RANGES = {"ppo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.2)}


@dataclass
class RolloutCorrectionConfig:
    """Rollout correction (rl/correction.py, docs/grpo.md): each token's loss weighted by rho = the
    trainer's old probability over the rollout's, against the rollout/trainer mismatch (a bf16 or FP8
    rollout copy, other kernels). Needs rl.old_logprobs=trainer (the trainer's old log-probs)."""

    # none; tis: weight min(rho, cap) (truncated importance sampling); mis: weight rho, tokens (or
    # sequences) whose rho leaves the band masked out of the loss (masked importance sampling)
    method: Literal["none", "tis", "mis"] = "none"
    level: Literal["token", "sequence"] = "token"  # rho per token, or one per sequence (the product)
    cap: float = 2.0  # tis: the largest weight (verl's rollout_is_threshold default)
    band: tuple[float, float] = (0.5, 2.0)  # mis: the rho kept, [lo, hi] (lo: verl's 1 / hi)

    def __post_init__(self):
        _range(self, "cap", ge=1, why="a cap below 1 would scale down tokens the rollout and trainer agree on")
        _require(len(self.band) == 2 and 0 < self.band[0] <= 1 <= self.band[1],
                 f"rl.rollout_correction.band must be [lo, hi] with 0 < lo <= 1 <= hi, got {list(self.band)}")


@dataclass
class RLConfig:
    # the reward functions, summed with their weights into each response's reward (rl/rewards.py)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    # Outcome advantages (rl/core.outcome_advantages): grpo (rewards centred on the group's mean,
    # scaled by adv_scale), rloo (the mean of the group's other responses as baseline), reinforce++
    # (rewards whitened over the batch), reinforce++-baseline (centred on the group, then whitened)
    advantage: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    adv_scale: Literal["group", "batch", "none"] = "group"  # grpo's: group std, batch std, none (Dr. GRPO)
    # The policy-gradient loss (rl/core.policy_loss): ppo (the clipped surrogate of GRPO; DAPO with
    # clip_high > clip_low; Dr. GRPO with adv_scale none and agg seq-mean-token-sum-norm), gspo (one
    # importance ratio a sequence), cispo (a truncated, detached importance weight on every token's
    # log-prob gradient: clipped tokens still learn)
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    # The ratio's bounds [1 - clip_low, 1 + clip_high]; null: each loss's own (ppo 0.2 / 0.2; gspo
    # 3e-4 / 4e-4, the paper's; cispo 1 / 0.2: no lower truncation, as MiniMax-M1)
    clip_low: float | None = None  # the ratio's lower bound is 1 - clip_low
    clip_high: float | None = None  # the ratio's upper bound is 1 + clip_high
    dual_clip: float | None = None  # ppo only
    # The ratio's old log-probs: rollout (the rollout engine's, free) or trainer (one more no-grad forward
    # a step, as the KL reference's, verl's recompute: for a clip band as narrow as gspo's, where the
    # engine's and the trainer's numerics already differ by about as much)
    old_logprobs: Literal["rollout", "trainer"] = "rollout"
    # against the rollout/trainer mismatch: the loss weighted by the trainer's over the rollout's
    # probabilities (needs old_logprobs: trainer); metrics rollout/* every step with old_logprobs: trainer
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # auto: seq-mean-token-mean with gspo (its objective: a mean over sequences), else token-mean
    agg: Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "auto"
    kl_beta: float = 0.0  # 0: no KL term and no reference forward
    kl_kind: Literal["k1", "k2", "k3"] = "k3"  # the KL estimator (Schulman's k1/k2/k3; k3: unbiased, >= 0)
    epochs: int = 1  # mu: optimisation passes over each rollout batch
    mini_batch_size: int = 16  # sequences per optimizer step within a pass
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill with new prompts
    max_sampling_tries: int = 3  # rollout rounds per step when dynamic sampling
    overlong_penalty: float = 0.0  # subtracted from the reward of responses cut at max_new_tokens
    # The update's log-prob forwards on real tokens only: a mini-batch part's prompts (no left
    # padding) and responses (no right padding) packed into one row, M-RoPE and attention per
    # sequence (docs/packing.md). auto = on where attention runs per sample without a dense mask
    # (model.attention.implementation=sdpa); off for eager / flex_attention / flash_attention_2
    packing: bool | Literal["auto"] = "auto"

    def __post_init__(self):
        for key in ("epochs", "mini_batch_size", "max_sampling_tries"):
            _range(self, key, ge=1)
        _require(bool(self.rewards), "rl.rewards needs at least one reward function")
        _range(self, "kl_beta", ge=0)
        if self.policy_loss == "cispo":  # a weight, not a ratio PPO's max() acts on: 0 is a valid lower bound
            _range(self, "clip_low", ge=0, le=1, why="the importance weight's lower bound is 1 - clip_low")
        else:
            _range(self, "clip_low", ge=0, lt=1, why="the ratio's lower bound is 1 - clip_low")
        _range(self, "clip_high", ge=0)
        _range(self, "dual_clip", gt=1)  # or null
        _require(self.dual_clip is None or self.policy_loss == "ppo",
                 f"rl.dual_clip bounds PPO's clipped surrogate; rl.policy_loss={self.policy_loss} has none: remove it")
        _require(self.adv_scale == "group" or self.advantage == "grpo",
                 f"rl.adv_scale={self.adv_scale} scales GRPO's advantages; rl.advantage={self.advantage} has its own "
                 "scaling: remove rl.adv_scale")
        _range(self, "overlong_penalty", ge=0, why="it is subtracted from the reward")
        _require(self.rollout_correction.method == "none" or self.old_logprobs == "trainer",
                 f"rl.rollout_correction.method={self.rollout_correction.method} weighs the trainer's old "
                 "log-probs against the rollout's: set rl.old_logprobs=trainer too")

    # The loss's settings with null / auto resolved (the config keeps them as written: a partial `rl`
    # section is merged over these defaults, so they must not be resolved when the section is built)
    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), each null taking rl.policy_loss's own (LOSS_CLIP_RANGES)."""
        low, high = LOSS_CLIP_RANGES[self.policy_loss]
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)

    @property
    def aggregation(self) -> str:
        """rl.agg with auto resolved: seq-mean-token-mean for gspo, else token-mean."""
        if self.agg != "auto":
            return self.agg
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"
