"""Config owned by components: old keys name their new place (YAML and overrides; an old run's
config.yaml migrates), and a run's config.yaml holds only keys that act, each read by vlforge."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vlforge.config import (RENAMED, ConfigError, GRPOConfig, SFTConfig, acting_tree, dump_config, load_config,
                            load_recipe_config, recipe_class)
from vlforge.config.model import DENSE_PRESETS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "vlforge" / "configs").glob("*.yaml"))
PACKAGE = ROOT / "vlforge"


def test_an_old_key_in_a_yaml_file_names_its_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("precision:\n  mode: bf16\n  gradient_checkpointing: true\n")
    with pytest.raises(ConfigError, match=r"old.yaml: 'precision.gradient_checkpointing' is now "
                                          r"'activation_checkpointing.enabled'"):
        load_config(SFTConfig, path)
    path.write_text("rollout:\n  engine: vlforge\n")
    with pytest.raises(ConfigError, match=r"'rollout.engine' was removed: .*bench/"):
        load_config(GRPOConfig, path)


def test_an_old_key_in_an_override_names_the_override_and_its_new_key():
    with pytest.raises(ConfigError, match=r"override 'precision.compile=true': 'precision.compile' is now "
                                          r"'compile.enabled'"):
        load_config(SFTConfig, None, ["train.max_steps=2", "precision.compile=true"])
    for old, new in RENAMED.items():  # every entry is refused, naming where it went (or why it went)
        with pytest.raises(ConfigError, match=re.escape(f"'{old}'")) as e:
            load_config(GRPOConfig, None, [f"{old}=1"])
        assert (new if not new.startswith("removed") else "was removed") in str(e.value)
    new_keys = [new for new in RENAMED.values() if not new.startswith("removed")]
    loaded = load_config(GRPOConfig, None, [f"{new}=2" for new in new_keys if new.endswith(("every", "turns"))]
                         + ["activation_checkpointing.enabled=true"])
    assert (loaded.activation_checkpointing.every, loaded.tools.turns) == (2, 2)  # the new keys are real


def test_a_tier_has_only_its_own_keys():
    for key in ("tiers.projector.mlp", "tiers.projector.last_n_blocks", "tiers.language.last_n_blocks",
                "tiers.vision.experts", "tiers.vision.router"):
        with pytest.raises(ConfigError, match="was removed"):
            load_config(SFTConfig, None, [f"{key}=true"])
    with pytest.raises(ConfigError, match="tiers.language.experts applies to LoRA"):  # at load, before any model
        load_config(SFTConfig, None, ["tiers.method=full", "tiers.language.experts=true"])


def test_an_old_runs_config_yaml_migrates(tmp_path):
    """A run directory from before the move (every key written, the old places) still loads for
    export / infer / serve: its keys move, the removed ones (that chose paths only) are dropped."""
    old = {"model": {"preset": "tiny", "attn_implementation": "eager", "packed_attention": "per_sample",
                     "vision_attention": "sdpa"},
           "tiers": {"projector": {"mlp": False, "last_n_blocks": 2}, "vision": {"experts": False, "router": False}},
           "precision": {"mode": "bf16", "compile": False, "gradient_checkpointing": True, "checkpoint_every": 2},
           "train": {"router_aux_loss_coef": 0.01},
           "rollout": {"engine": "vlforge", "tools": ["calculator"], "tool_turns": 3, "tool_image_max_pixels": 4096},
           "rl": {}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match="is now"):  # as a user's YAML: refused
        load_recipe_config(path)
    cfg = load_recipe_config(path, run=True)
    assert isinstance(cfg, GRPOConfig)
    assert (cfg.model.attention.implementation, cfg.model.attention.vision) == ("eager", "sdpa")
    assert (cfg.compile.enabled, cfg.activation_checkpointing.enabled, cfg.activation_checkpointing.every) == (
        False, True, 2)
    assert cfg.loss.router_aux_loss_coef == 0.01
    assert (cfg.tools.names, cfg.tools.turns, cfg.tools.image_max_pixels) == (["calculator"], 3, 4096)


def test_dense_presets_are_the_presets_without_experts():
    from vlforge.model.presets import MOE_PRESETS, PRESETS

    assert set(DENSE_PRESETS) == set(PRESETS) - set(MOE_PRESETS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_dumped_config_loads_back_to_the_same_run(path, tmp_path):
    cfg = load_recipe_config(path)
    out = tmp_path / "config.yaml"
    out.write_text(dump_config(cfg))
    back = load_recipe_config(out)
    assert type(back) is type(cfg)
    assert back == cfg  # shipped recipes leave inactive keys at their defaults: the same config
    assert dump_config(back) == dump_config(cfg)


def test_inactive_settings_are_dropped_and_load_back_to_the_same_dump(tmp_path):
    cfg = load_config(SFTConfig, None, ["precision.fp8.recipe=rowwise", "tiers.vision.train=false",
                                        "tiers.vision.r=64"])
    tree = acting_tree(cfg)
    assert "fp8" not in tree["precision"] and tree["tiers"]["vision"] == {"train": False}
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    assert dump_config(load_config(SFTConfig, tmp_path / "c.yaml")) == dump_config(cfg)


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("columns", "kwargs"):  # free-form mappings: their own keys
            out += _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                out += _leaves(item, f"{prefix}{key}[].")
        else:
            out.append(prefix + key)
    return out


def _code_outside_config() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in PACKAGE.rglob("*.py") if "config" not in p.parts[-2:-1]
                     and p.parent.name != "config")


def _read(name: str, code: str) -> bool:
    """The field `name` is read in vlforge outside the config package: as `.name` or by getattr / a string key."""
    return re.search(rf"\.{name}\b|getattr\([^)]*[\"']{name}[\"']|[\"']{name}[\"']", code) is not None


# The sections dump_config leaves out of a shipped recipe's run (a demo on a dense CPU preset, fp8 off,
# nothing quantized, ...): with the omission switched off, these appear and the test fails
CONDITIONAL = {"precision.fp8", "precision.loss_scale", "quant", "tiers.expert_lora", "tools"}


@pytest.mark.parametrize("acting_only", [True, False], ids=["acting", "every-key"])
def test_a_runs_config_yaml_holds_only_keys_that_act(acting_only):
    """For each shipped recipe: every leaf key of its run's config.yaml is read somewhere in vlforge
    outside the config package, and the sections that do nothing in it are absent. `every-key`
    switches the omission off: then the check must fail (a test that passes without its feature is
    a defect)."""
    code, failures = _code_outside_config(), []
    for path in CONFIGS:
        cfg = load_recipe_config(path)
        tree = yaml.safe_load(dump_config(cfg, acting_only=acting_only))
        unread = [k for k in _leaves(tree) if not _read(k.rsplit(".", 1)[-1].removesuffix("[]"), code)]
        present = [k for k in CONDITIONAL if _has(tree, k) and not _acts(cfg, k)]
        if unread or present:
            failures.append(f"{path.name}: unread {unread}, inactive sections present {present}")
    if acting_only:
        assert not failures, "\n".join(failures)
    else:
        assert failures, "every key dumped, yet the check found nothing to object to: it cannot fail"


def _has(tree: dict, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _acts(cfg, dotted: str) -> bool:
    """Whether a conditional section acts in this config (the shipped ones: which of them turn it on)."""
    if dotted == "precision.fp8":
        return cfg.precision.fp8.enabled
    if dotted == "precision.loss_scale":
        return cfg.precision.mode == "fp16"
    if dotted == "quant":
        return cfg.quant.enabled
    if dotted == "tiers.expert_lora":
        return cfg.tiers.language.experts and cfg.tiers.method == "lora"
    return bool(getattr(getattr(cfg, "tools", None), "names", None))


def test_the_recipe_class_of_a_dump_is_kept():
    assert recipe_class(yaml.safe_load(dump_config(GRPOConfig()))) is GRPOConfig
    assert recipe_class(yaml.safe_load(dump_config(SFTConfig()))) is SFTConfig
