"""Typed recipe configs owned by their components: each file holds the sections of one part of
vlforge (model.py: model, tiers, quant; data.py; train.py: loss, precision, compile, activation
checkpointing, optim, train, distributed, eval, log, health; rl.py: rollout, tools, rl), load.py the
YAML loader and its checks, recipes.py the SFT and GRPO configs composed of them.

    cfg = load_config(SFTConfig, "configs/demo-sft.yaml", ["tiers.language.lr=1e-3", "train.max_steps=10"])

Every name is importable from `vlforge.config`.
"""

from .data import COLUMN_KEYS, DataConfig
from .load import RENAMED, ConfigError, load_config, merge, migrate_old_keys, parse_overrides, read_file, to_dict
from .model import (DENSE_PRESETS, EXPERT_METHODS_WHY, AttentionConfig, LanguageTier, ModelConfig, ProjectorTier,
                    QuantConfig, TierConfig, TiersConfig, VisionTier)
from .recipes import (GRPO_ONLY_SECTIONS, GRPOConfig, RunConfig, SFTConfig, acting_tree, dump_config,
                      load_recipe_config, recipe_class, resolve_paths)
from .rl import LOSS_CLIP_RANGES, RewardConfig, RLConfig, RolloutConfig, RolloutCorrectionConfig, ToolsConfig
from .train import (ActivationCheckpointingConfig, CompileConfig, DistributedConfig, EvalConfig, FP8Config,
                    HealthConfig, LogConfig, LossConfig, LossScaleConfig, ModuleOverride, OptimConfig,
                    PrecisionConfig, TERecipeConfig, TrainConfig)

__all__ = [
    "COLUMN_KEYS", "DENSE_PRESETS", "EXPERT_METHODS_WHY", "GRPO_ONLY_SECTIONS", "LOSS_CLIP_RANGES", "RENAMED",
    "ActivationCheckpointingConfig", "AttentionConfig", "CompileConfig", "ConfigError", "DataConfig",
    "DistributedConfig", "EvalConfig", "FP8Config", "GRPOConfig", "HealthConfig", "LanguageTier", "LogConfig",
    "LossConfig", "LossScaleConfig", "ModelConfig", "ModuleOverride", "OptimConfig", "PrecisionConfig",
    "ProjectorTier", "QuantConfig", "RLConfig", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "RunConfig", "SFTConfig",
    "TERecipeConfig", "TierConfig", "TiersConfig", "ToolsConfig", "TrainConfig", "VisionTier", "acting_tree",
    "dump_config", "load_config", "load_recipe_config", "merge", "migrate_old_keys", "parse_overrides",
    "read_file", "recipe_class", "resolve_paths", "to_dict",
]
