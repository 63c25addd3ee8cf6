import dataclasses
import os
import typing
from pathlib import Path

import pytest

from vlforge.config import (ConfigError, GRPOConfig, SFTConfig, dump_config, load_config, load_recipe_config,
                            recipe_class, resolve_paths)

CONFIG_DIR = Path(__file__).parents[1] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"demo-sft.yaml", "qwen3vl-2b-lora.yaml", "qwen3vl-8b-lora.yaml", "qwen3vl-2b-full.yaml",
            "demo-grpo.yaml", "qwen3vl-2b-grpo.yaml", "qwen3vl-8b-grpo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_yaml_loads_and_starts_with_its_command(path):
    first = path.read_text().splitlines()[0]
    command = first.split()[2]  # "# vlforge sft|grpo configs/NAME ..."
    assert first.startswith(f"# vlforge {command} configs/{path.relative_to(CONFIG_DIR)}")
    cfg = load_recipe_config(path)  # the class recipe_class picks is the one its command uses
    assert type(cfg) is {"sft": SFTConfig, "grpo": GRPOConfig}[command]
    assert cfg.model.preset or cfg.model.path


def test_recipe_class_picks_grpo_by_its_own_sections(tmp_path):
    assert recipe_class({}) is SFTConfig and recipe_class({"train": {}, "optim": {}}) is SFTConfig
    assert recipe_class({"rl": {}}) is GRPOConfig and recipe_class({"rollout": {"group_size": 4}}) is GRPOConfig
    for cls in (SFTConfig, GRPOConfig):  # a run's config.yaml (every section written) comes back as its class
        path = tmp_path / f"{cls.__name__}.yaml"
        path.write_text(dump_config(cls()))
        assert type(load_recipe_config(path)) is cls
    assert type(load_recipe_config(None, ["rollout.group_size=4"])) is GRPOConfig  # overrides count too


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


def test_an_error_names_the_override_that_gave_the_bad_value_not_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {preset: tiny}\ndata: {max_pixels: 200000}\noptim: {warmup_steps: 10}\n")
    for overrides, message in [
        (["train.batch_size=abc"], "override 'train.batch_size=abc': train.batch_size: expected int, got 'abc'"),
        (["train.seed=3", "optim.lr=1e-4"], "override 'optim.lr=1e-4': unknown key 'optim.lr'"),
        # a check across keys: the override that broke it (against the file's max_pixels), not its neighbour
        (["train.seed=3", "data.min_pixels=300000"], "override 'data.min_pixels=300000': data.min_pixels must be"),
        # two that are wrong only together are both named
        (["data.min_pixels=150000", "data.max_pixels=100000"],
         "overrides 'data.min_pixels=150000', 'data.max_pixels=100000': data.min_pixels must be"),
        (["train.seed=[3"], "override 'train.seed=[3': the value is not valid YAML"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_recipe_config(path, overrides)
        assert str(e.value).startswith(message) and str(path) not in str(e.value), str(e.value)
    path.write_text("model: {preset: tiny}\ntrain: {batch_size: abc}\n")  # the file's own error stays the file's
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, path, ["train.seed=3", "train.batch_size=abc"])
    assert str(e.value).startswith(f"{path}: train.batch_size: expected int, got 'abc'"), str(e.value)


def test_out_of_range_values_are_config_errors():
    for override, message in [("train.batch_size=0", "train.batch_size must be >= 1"),
                              ("log.every=0", "log.every must be >= 1"),
                              ("tiers.language.dropout=1.5", r"tiers.language.dropout must be in \[0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            load_config(SFTConfig, None, [override])
    for override, message in [("rl.mini_batch_size=0", "rl.mini_batch_size must be >= 1"),
                              ("rollout.group_size=1", "group_size must be >= 2"),
                              ("rl.dual_clip=0.5", "dual_clip must be > 1")]:
        with pytest.raises(ConfigError, match=message):
            load_config(GRPOConfig, None, [override])


# ----------------------------------------------------------------------------- every numeric key


NEGATIVE_OK = {"rl.rewards[0].weight"}  # a negative reward weight is a penalty


def _numeric_keys(cls, prefix=""):
    """(dotted key, type, override(value) -> list of overrides) for every int/float field, nested
    sections, list-of-section items and tuple elements included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_keys(tp, key + ".")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            for sub, sub_tp, _ in _numeric_keys(args[0]):
                yield f"{key}[0].{sub}", sub_tp, lambda v, key=key, sub=sub: [f"{key}=[{{{sub}: {v}}}]"]
        elif typing.get_origin(tp) is tuple:
            for i, arg in enumerate(args):
                yield key, arg, lambda v, key=key, i=i, n=len(args): [
                    f"{key}=[{', '.join(v if j == i else '0.5' for j in range(n))}]"]
        else:
            numeric = [a for a in (args if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType)
                                   else [tp]) if a in (int, float)]
            if numeric:
                yield key, numeric[0], lambda v, key=key: [f"{key}={v}"]


def test_every_numeric_key_has_a_range_check_naming_it():
    checked = set()
    for cls in (SFTConfig, GRPOConfig):
        for key, tp, override in _numeric_keys(cls):
            bad = [".nan", ".inf", "-.inf"] if tp is float else []
            if key not in NEGATIVE_OK:
                bad.append("-1")
            for value in bad:
                with pytest.raises(ConfigError) as e:
                    load_config(cls, None, override(value))
                assert key in str(e.value), (key, value, str(e.value))
            checked.add(key)
    # the walk really visits the sections (it would pass vacuously on an empty list)
    assert {"optim.eps", "optim.betas", "optim.max_grad_norm", "tiers.vision.lr", "precision.loss_scale.init_scale",
            "precision.fp8.te_vision.margin", "rollout.top_p", "rl.rewards[0].weight", "data.num_workers",
            "model.seed", "eval.max_samples"} <= checked
    assert len(checked) > 50


def test_upper_bounds_and_choices_are_named():
    for override, message in [("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio must be in \[0, 1\], got 1.5"),
                              ("optim.betas=[0.9,1.0]", r"optim.betas must be in \[0, 1\)"),
                              ("optim.eps=0", "optim.eps must be > 0"),
                              ("optim.max_grad_norm=0", "optim.max_grad_norm must be > 0"),
                              ("tiers.projector.alpha=0", "tiers.projector.alpha must be > 0"),
                              ("precision.loss_scale.backoff_factor=1", r"backoff_factor must be in \(0, 1\)"),
                              ("train.device=tpu", "train.device: 'tpu' is not one of auto, cpu, cuda, cuda:N, mps"),
                              ("train.device=cuda:x", "train.device: 'cuda:x'"),
                              ("data.num_workers=lots", "data.num_workers"),
                              ("optim.eps='1e-8x'", "optim.eps: expected float")]:
        with pytest.raises(ConfigError, match=message):
            load_config(SFTConfig, None, [override])
    for override, message in [("rollout.top_p=1.5", r"rollout.top_p must be in \(0, 1\]"),
                              ("rl.clip_low=1", r"rl.clip_low must be in \[0, 1\)")]:
        with pytest.raises(ConfigError, match=message):
            load_config(GRPOConfig, None, [override])
    for ok in ("train.device=cuda:1", "train.device=mps", "optim.max_grad_norm=null", "optim.betas=[0.0,0.95]"):
        load_config(SFTConfig, None, [ok])  # valid spellings stay valid
    assert load_config(SFTConfig, None, []).data.num_workers == "auto"
    assert load_config(SFTConfig, None, ["data.num_workers=2"]).data.num_workers == 2


# ----------------------------------------------------------------------------- file problems and paths


def test_unreadable_yaml_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model:\n  path: /models/caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{path}:2: not UTF-8 text \(byte 26"):
        load_config(SFTConfig, path)
    for text, message in [("1: x\n", "key 1 is not a name"),
                          ("train: {1: 2}\n", "train: key 1 is not a name"),
                          ("rl:\n  rewards: [{name: format, kwargs: {3: x}}]\n", r"rl.rewards\[0\].kwargs: key 3")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"{path}: {message}"):
            load_recipe_config(path)


def test_resolve_paths_makes_run_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(GRPOConfig, None, ["model.path=models/base", "data.train=data/train.jsonl", "data.val=null",
                                         "rl.rewards=[{name: rewards/mine.py:score}, {name: exact_match}]"])
    resolved = resolve_paths(cfg)
    assert resolved.model.path == str(tmp_path / "models/base")
    assert resolved.data.train == str(tmp_path / "data/train.jsonl") and resolved.data.val is None
    assert [r.name for r in resolved.rl.rewards] == [f"{tmp_path}/rewards/mine.py:score", "exact_match"]
    assert cfg.model.path == "models/base"  # a copy: the caller's config is unchanged
    monkeypatch.chdir("/")  # absolute paths stay as they are, from any directory
    assert resolve_paths(resolved) == resolved
    assert resolve_paths(SFTConfig()).model.path is None
    assert os.path.isabs(resolve_paths(load_config(SFTConfig, None, ["model.path=x"])).model.path)


def test_grpo_relatives_settings_resolve_per_loss_and_refuse_what_does_not_apply():
    """rl.clip_low / clip_high null and rl.agg auto take each policy loss's own (GSPO's paper values);
    a partial `rl` section keeps them unresolved (they follow a later policy_loss); PPO's dual clip
    and GRPO's adv_scale are refused where they do not apply, naming the key."""
    cfg = load_config(GRPOConfig, None, ["rl.policy_loss=gspo"])
    assert cfg.rl.clip_low is None and cfg.rl.agg == "auto"
    assert cfg.rl.clip_range == (3e-4, 4e-4) and cfg.rl.aggregation == "seq-mean-token-mean"
    cfg = load_config(GRPOConfig, None, ["rl.policy_loss=cispo", "rl.clip_high=2.0"])
    assert cfg.rl.clip_range == (1.0, 2.0) and cfg.rl.aggregation == "token-mean"
    assert load_config(GRPOConfig, None, ["rl.policy_loss=cispo", "rl.clip_low=1"]).rl.clip_range[0] == 1.0
    assert load_config(GRPOConfig, None, []).rl.clip_range == (0.2, 0.2)
    with pytest.raises(ConfigError, match="rl.dual_clip bounds PPO's"):
        load_config(GRPOConfig, None, ["rl.policy_loss=gspo", "rl.dual_clip=3"])
    with pytest.raises(ConfigError, match="rl.adv_scale=none scales GRPO's"):
        load_config(GRPOConfig, None, ["rl.advantage=rloo", "rl.adv_scale=none"])
    with pytest.raises(ConfigError, match="rl.policy_loss"):
        load_config(GRPOConfig, None, ["rl.policy_loss=ppo2"])
