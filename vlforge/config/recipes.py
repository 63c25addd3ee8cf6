"""The recipes' configs, composed of the components' sections: SFTConfig (`vlforge sft`) and
GRPOConfig (`vlforge grpo`), the checks across sections, and a run's config.yaml (dump_config:
only the keys that act in this run)."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .data import DataConfig
from .load import ConfigError, _require, build_named, merge, migrate_old_keys, parse_overrides, read_file, to_dict
from .model import ModelConfig, QuantConfig, TiersConfig
from .rl import RLConfig, RolloutConfig, ToolsConfig
from .train import (ActivationCheckpointingConfig, CompileConfig, DistributedConfig, EvalConfig, HealthConfig,
                    LogConfig, LossConfig, OptimConfig, PrecisionConfig, TrainConfig)


@dataclass
class RunConfig:
    """The sections every training recipe has; SFTConfig and GRPOConfig add their own."""

    model: ModelConfig = field(default_factory=ModelConfig)  # which model, and its attention kernels
    data: DataConfig = field(default_factory=DataConfig)  # the data and how it is batched
    loss: LossConfig = field(default_factory=LossConfig)  # how the loss is computed
    tiers: TiersConfig = field(default_factory=TiersConfig)  # what trains, LoRA or full
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # dtypes and FP8
    compile: CompileConfig = field(default_factory=CompileConfig)  # torch.compile and CUDA graphs
    # recompute activations in backward instead of keeping them
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)  # the optimizer and the lr schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # steps, batches, checkpoints
    eval: EvalConfig = field(default_factory=EvalConfig)  # periodic evaluation on data.val
    log: LogConfig = field(default_factory=LogConfig)  # metrics, samples and trackers
    health: HealthConfig = field(default_factory=HealthConfig)  # the gradient-health monitor
    quant: QuantConfig = field(default_factory=QuantConfig)  # quantized weights (QLoRA)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # FSDP2 / DDP

    def __post_init__(self):
        """The checks across sections, at load (before any model loads), each naming its keys."""
        fp8, quant = self.precision.fp8, self.quant
        checkpointing = self.activation_checkpointing.enabled is True  # auto recomputes nothing where refused here
        _require(not (self.compile.cuda_graphs and (checkpointing or fp8.enabled)),
                 "compile.cuda_graphs is built and measured for non-FP8 layers without recomputation: turn off "
                 "activation_checkpointing.enabled and precision.fp8.enabled, or compile.cuda_graphs")
        _require(not (quant.enabled and self.tiers.method != "lora"),
                 "quant (QLoRA) needs tiers.method=lora: quantized base weights cannot be trained directly")
        _require(not (quant.expert_method != "none" and self.tiers.language.experts and self.tiers.expert_lora == "peft"),
                 "tiers.expert_lora=peft cannot run on NF4 experts: peft's forward adds its update as a "
                 "parametrization after bitsandbytes' dequantizing one and does not remove it, so every "
                 "call stacks one more; use tiers.expert_lora=fused (the default) or quant.experts=none")
        _require(not (fp8.enabled and quant.enabled),
                 "precision.fp8 and quant cannot be combined: FP8 training converts plain bf16 linears, "
                 "a quantized base has none; use QLoRA (quant) or FP8, not both")
        _require(not (fp8.enabled and fp8.backend == "te" and checkpointing),
                 "precision.fp8.backend=te with activation_checkpointing.enabled: the recomputation runs "
                 "outside te.autocast; use the torchao backend or turn activation checkpointing off")


@dataclass
class SFTConfig(RunConfig):
    """`vlforge sft`: the shared sections only."""


@dataclass
class GRPOConfig(RunConfig):
    """`vlforge grpo`: the shared sections (another default output_dir, length and router loss) +
    rollout, tools and rl."""

    # GRPO: no router load-balancing term by default (loss.router_aux_loss_coef says why)
    loss: LossConfig = field(default_factory=lambda: LossConfig(router_aux_loss_coef=0.0))
    # GRPO's own output_dir and a fixed length (its steps are rollout rounds, not passes over data.train)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/grpo", max_steps=100))
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # sampling the groups of responses
    tools: ToolsConfig = field(default_factory=ToolsConfig)  # multi-turn tool rollouts
    rl: RLConfig = field(default_factory=RLConfig)  # rewards, advantages and the policy loss

    def __post_init__(self):
        super().__post_init__()
        if self.tools.names and self.rollout.router_replay is not False:
            raise ConfigError(f"tools.names with rollout.router_replay={self.rollout.router_replay}: the experts of "
                              "a multi-turn rollout's later turns are not recorded; remove one of the two")
        if self.rollout.precision == "fp8" and self.quant.language != "none":
            raise ConfigError(f"rollout.precision=fp8 with quant.language={self.quant.language}: the FP8 copies are "
                              "made from unquantized weights; use rollout.precision=bf16 or an unquantized base")


GRPO_ONLY_SECTIONS = ("rl", "rollout", "tools")


def recipe_class(data: dict) -> type:
    """SFTConfig or GRPOConfig for a config tree: GRPO's is the one with an `rl`, `rollout` or `tools` section."""
    return GRPOConfig if any(k in data for k in GRPO_ONLY_SECTIONS) else SFTConfig


def load_recipe_config(path: str | Path | None, overrides: list[str] | None = None, *,
                       run: bool = False) -> SFTConfig | GRPOConfig:
    """load_config with the class picked by recipe_class (for commands that take either kind of run,
    e.g. a run's config.yaml: dump_config always writes `rl`, so GRPO runs are told apart). `run`:
    `path` is a run's own config.yaml, whose old keys (a run of an earlier vlforge) are migrated
    (load.migrate_old_keys) rather than refused."""
    file_tree = read_file(path)
    if run:
        file_tree = migrate_old_keys(file_tree)
    cls = recipe_class(merge(file_tree, parse_overrides(overrides or [])))
    return build_named(cls, file_tree, path, overrides or [])


def resolve_paths(cfg: Any) -> Any:
    """A copy of `cfg` with relative file paths made absolute (against the current directory), for
    the run's config.yaml: its checkpoints then export/infer/serve from any working directory."""
    def absolute(p: str | None) -> str | None:
        return os.path.abspath(p) if p else p

    cfg = copy.deepcopy(cfg)
    cfg.model.path = absolute(cfg.model.path)
    cfg.data.train, cfg.data.val = absolute(cfg.data.train), absolute(cfg.data.val)
    for reward in getattr(getattr(cfg, "rl", None), "rewards", []):
        file, sep, fn = reward.name.rpartition(":")
        if sep and file.endswith(".py"):  # path/to/file.py:function (load_reward expands ~); builtins are names
            reward.name = f"{absolute(os.path.expanduser(file))}:{fn}"
        if (reward.name == "judge" and reward.kwargs.get("model") not in (None, "tiny")
                and not reward.kwargs.get("endpoint")):  # a local judge's model directory (an endpoint's: a name)
            reward.kwargs = {**reward.kwargs, "model": absolute(os.path.expanduser(str(reward.kwargs["model"])))}
    return cfg


def dump_config(cfg: Any, *, acting_only: bool = True) -> str:
    """The config as YAML. `acting_only` (a run's config.yaml, --print-config): only the keys that act
    in this run (acting_tree); loading it back gives the same run. False: every key."""
    return yaml.safe_dump(acting_tree(cfg) if acting_only else to_dict(cfg), sort_keys=False)


def _drop(section: dict, *keys: str) -> None:
    for key in keys:
        section.pop(key, None)


def acting_tree(cfg: Any) -> dict:
    """to_dict(cfg) without the keys this run never reads: a reader of its config.yaml sees what
    acted. Each rule below names the condition under which the code reads the keys it drops (loading
    the tree back fills them with their defaults, which then do nothing either)."""
    tree = to_dict(cfg)
    model, tiers, precision = tree["model"], tree["tiers"], tree["precision"]
    if cfg.model.path:  # a directory's own weights: the preset (and its init seed) are not used
        _drop(model, "preset", "seed")
    if cfg.precision.mode != "fp16":  # loss scaling exists for fp16's narrow range only
        _drop(precision, "loss_scale")
    if not cfg.precision.fp8.enabled:
        _drop(precision, "fp8")
    else:  # each backend reads its own recipe keys
        _drop(precision["fp8"], *(("recipe",) if cfg.precision.fp8.backend == "te" else ("te", "te_vision")))
    _acting_tiers(cfg, tiers)
    if cfg.compile.enabled is False:  # the vision blocks, graphs and budget all ride on compiled layers
        _drop(tree["compile"], "vision", "cuda_graphs", "cuda_graphs_vision", "activation_memory_budget")
    elif not cfg.compile.cuda_graphs:
        _drop(tree["compile"], "cuda_graphs_vision")
    if cfg.activation_checkpointing.enabled is not True:  # false: nothing recomputed; auto: chooses every itself
        _drop(tree["activation_checkpointing"], "every")
    if cfg.loss.impl in ("liger", "plain"):  # chunk_size sizes our chunked loss only
        _drop(tree["loss"], "chunk_size")
    if not cfg.quant.enabled:
        tree.pop("quant")
    elif "nf4" not in (cfg.quant.vision, cfg.quant.projector):  # it unlocks 4-bit vision weights only
        _drop(tree["quant"], "allow_4bit_vision")
    if not cfg.data.stream:
        _drop(tree["data"], "stream_window")
    _acting_log(cfg, tree["log"])
    if cfg.distributed.strategy in ("none", "ddp"):  # FSDP2's own keys
        _drop(tree["distributed"], "reshard_after_forward", "cpu_offload", "layers_per_unit", "meta_init")
    if "rl" in tree:
        _acting_grpo(cfg, tree)
    if cfg.model.dense:  # a dense model has no experts or router: their keys do nothing
        _drop(model, "experts_implementation")
        _drop(tiers, "expert_lora")
        _drop(tiers.get("language", {}), "experts", "router")
        _drop(tree["loss"], "router_aux_loss_coef")
        _drop(tree.get("quant", {}), "experts")
        _drop(tree.get("rollout", {}), "router_replay")
    return tree


def _acting_tiers(cfg: Any, tiers: dict) -> None:
    """A frozen tier shows only train: false; a full fine-tune no LoRA keys (r, alpha, dropout, mlp: LoRA
    targets); expert_lora only where the language tier's experts get LoRA."""
    for name in ("language", "projector", "vision"):
        if not getattr(cfg.tiers, name).train:
            tiers[name] = {"train": False}
        elif cfg.tiers.method == "full":
            _drop(tiers[name], "r", "alpha", "dropout", "mlp", "experts")
    if not (cfg.tiers.method == "lora" and cfg.tiers.language.train and cfg.tiers.language.experts):
        _drop(tiers, "expert_lora")


def _acting_log(cfg: Any, log: dict) -> None:
    if not cfg.log.mlflow:
        _drop(log, "mlflow_uri")
    if not (cfg.log.wandb or cfg.log.mlflow):  # the trackers' project and run name
        _drop(log, "project", "run_name")


def _acting_grpo(cfg: Any, tree: dict) -> None:
    if not cfg.tools.names:  # no tools: single-turn rollouts read none of the tool settings
        tree.pop("tools")
    if cfg.rl.policy_loss != "ppo":  # validated null: PPO's dual clip only
        _drop(tree["rl"], "dual_clip")
    if cfg.rl.advantage != "grpo":  # validated `group`: GRPO's scaling only
        _drop(tree["rl"], "adv_scale")
    correction = cfg.rl.rollout_correction
    if correction.method == "none":
        _drop(tree["rl"], "rollout_correction")
    else:  # each method reads its own bound
        _drop(tree["rl"]["rollout_correction"], "band" if correction.method == "tis" else "cap")
