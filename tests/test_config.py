from pathlib import Path

import pytest

from vlforge.config import ConfigError, GRPOConfig, SFTConfig, load_config

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"demo-sft.yaml", "qwen3vl-2b-lora.yaml", "qwen3vl-8b-lora.yaml", "qwen3vl-2b-full.yaml",
            "demo-grpo.yaml", "qwen3vl-2b-grpo.yaml", "qwen3vl-8b-grpo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_yaml_loads_and_starts_with_its_command(path):
    first = path.read_text().splitlines()[0]
    command = first.split()[2]  # "# vlforge sft|grpo configs/NAME ..."
    assert first.startswith(f"# vlforge {command} configs/{path.name}")
    cfg = load_config({"sft": SFTConfig, "grpo": GRPOConfig}[command], path)
    assert cfg.model.preset or cfg.model.path


def test_overrides_keep_section_defaults():
    cfg = load_config(SFTConfig, None, ["tiers.language.r=4", "optim.weight_decay=0.1", "optim.betas=[0.9,0.95]"])
    assert cfg.tiers.language.r == 4
    assert cfg.tiers.language.lr == 2e-4  # the language tier's own default survives a partial override
    assert cfg.optim.weight_decay == 0.1 and cfg.optim.betas == (0.9, 0.95)


def test_unknown_key_suggests_nearest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  weight_decy: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optim.weight_decy': did you mean 'weight_decay'"):
        load_config(SFTConfig, path)
    with pytest.raises(ConfigError, match=r"did you mean 'tiers'"):
        load_config(SFTConfig, None, ["tier.language.r=4"])


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"precision.mode: 'bf32' is not one of"):
        load_config(SFTConfig, None, ["precision.mode=bf32"])
    with pytest.raises(ConfigError, match=r"train.batch_size: expected int"):
        load_config(SFTConfig, None, ["train.batch_size=lots"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(SFTConfig, None, ["optim.eps"])


def test_out_of_range_values_are_config_errors():
    for override, message in [("train.batch_size=0", "train.batch_size must be >= 1"),
                              ("log.every=0", "log.every must be >= 1"),
                              ("tiers.language.dropout=1.5", "dropout < 1")]:
        with pytest.raises(ConfigError, match=message):
            load_config(SFTConfig, None, [override])
    for override, message in [("rl.mini_batch_size=0", "rl.mini_batch_size must be >= 1"),
                              ("rollout.group_size=1", "group_size must be >= 2"),
                              ("rl.dual_clip=0.5", "dual_clip must be > 1")]:
        with pytest.raises(ConfigError, match=message):
            load_config(GRPOConfig, None, [override])
