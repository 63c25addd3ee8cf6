import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import GRPOConfig, load_config
from vlforge.recipes.grpo import run_grpo
from vlforge.rl.rewards import RewardError
from vlforge.model.tiers import unwrap

VARIED_REWARD = "def varied(completion, answer, **row):\n    return float(len(completion) % 3)\n"
FAILING_REWARD = "def broken(completion, answer, **row):\n    return {'not': 'a number'}\n"


def grpo_config(shapes_dir, out_dir, tmp_path, *overrides, reward="varied") -> GRPOConfig:
    (tmp_path / "rewards.py").write_text(VARIED_REWARD + FAILING_REWARD)
    return load_config(GRPOConfig, None, [
        "model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}", "data.val=null", "precision.mode=fp32",
        "train.device=cpu", f"train.output_dir={out_dir}", "train.max_steps=1", "log.progress=false",
        "rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=5", "rl.mini_batch_size=4",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:{reward}'}}]", "tiers.vision.train=true",
        "tiers.vision.last_n_blocks=1", "optim.schedule=constant", "optim.max_grad_norm=null", *overrides])


@pytest.mark.parametrize("method,extra", [
    ("lora", ["rl.kl_beta=0.1"]), ("full", ["rl.kl_beta=0.1"]),
    # QLoRA: NF4 language model, KL to the adapter-disabled NF4 base
    # (also the regression test of quant.keep_trainable: after the first rollout's eval-mode forward,
    # bitsandbytes' CPU repacking cut every gradient below the NF4 layers)
    ("lora", ["rl.kl_beta=0.1", "quant.language=nf4", "precision.mode=bf16"]),
])
def test_one_grpo_step_changes_exactly_the_trainable_params(shapes_dir, tmp_path, method, extra, monkeypatch):
    # 8 sequences in mini-batches of 4: two optimizer steps, so LoRA A moves too (B starts at zero)
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, f"tiers.method={method}", *extra)
    from vlforge.recipes import grpo as recipe

    captured = {}
    original = recipe.setup_model

    def capture(c, **kwargs):
        t = original(c, **kwargs)
        captured["t"] = t
        captured["before"] = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return t

    monkeypatch.setattr(recipe, "setup_model", capture)  # a spy: keeps the real model to inspect
    run_grpo(cfg)
    t, before = captured["t"], captured["before"]
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] > 0 and row["adv_std"] > 0
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"
    for key in ["reward_mean", "reward_std", "accuracy", "adv_mean", "kl", "clip_frac", "entropy",
                "response_length_mean", "response_length_max", "zero_var_group_frac", "time_rollout_s",
                "time_train_s", "tokens_per_s", f"reward/{tmp_path / 'rewards.py'}:varied",
                "grad_norm", "grad_norm/language", "grad_norm/projector", "grad_norm/vision", "skipped"]:
        assert key in row, key
    assert (tmp_path / "run" / "reward.png").exists()


def test_adapter_disabled_reference_equals_the_base_model(tiny, shapes_dir, tmp_path):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.config import DataConfig, SFTConfig
    from vlforge.model.tiers import apply_plan, build_plan

    base = copy.deepcopy(tiny[0]).eval()
    model = apply_plan(copy.deepcopy(tiny[0]), build_plan(tiny[0], load_config(SFTConfig, None, ["tiers.vision.train=true"]).tiers))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a trained adapter
    model.eval()
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny[1], DataConfig())
    batch = {k: v for k, v in collate([data[i] for i in range(4)], data.encoder.pad_id).items() if k != "labels"}
    with torch.no_grad():
        adapted = unwrap(model)(**batch).logits
        with model.disable_adapter():
            reference = unwrap(model)(**batch).logits
        expected = base(**batch).logits
    assert not torch.allclose(adapted, expected, atol=1e-3)
    torch.testing.assert_close(reference, expected, atol=1e-6, rtol=1e-6)


def test_failing_reward_names_the_function_and_sample(shapes_dir, tmp_path):
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, reward="broken")
    with pytest.raises(RewardError, match=r"broken.*sample 0"):
        run_grpo(cfg)


def test_grpo_resume_equals_uninterrupted(shapes_dir, tmp_path):
    common = ["tiers.method=full", "rl.kl_beta=0.0", "train.save_every=2"]
    run_grpo(grpo_config(shapes_dir, tmp_path / "straight", tmp_path, "train.max_steps=4", *common))
    run_grpo(grpo_config(shapes_dir, tmp_path / "split", tmp_path, "train.max_steps=2", *common))
    run_grpo(grpo_config(shapes_dir, tmp_path / "split", tmp_path, "train.max_steps=4", "train.resume=auto", *common))
    a = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-4" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_reward_functions_see_exactly_the_response_text(shapes_dir, tmp_path):
    """Completions given to rewards are the decoded response only: nothing after <|im_end|>."""
    from vlforge.data.dataset import load_dataset
    from vlforge.recipes.grpo import rollout_round
    from vlforge.recipes.sft import setup_model
    from vlforge.rl import build_rewards

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "rollout.max_new_tokens=6")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    eos = data.encoder.im_end_id

    def end_at_once(module, inputs, logits):  # even-numbered responses end at once, the others run on
        logits = logits.clone()
        logits[0::2, ..., eos] += 100.0
        return logits

    unwrap(t.model).lm_head.register_forward_hook(end_at_once)
    seen = []
    spy = lambda completion, answer, **row: seen.append(completion) or 0.0  # noqa: E731
    import vlforge.rl.rewards as rewards_module

    rewards_module.BUILTIN_REWARDS["spy"] = spy
    try:
        rollout, _ = rollout_round(t, data, [0, 1], cfg, build_rewards(["spy"]))
    finally:
        del rewards_module.BUILTIN_REWARDS["spy"]
    lengths = rollout.response_mask.sum(1).tolist()
    assert lengths[0::2] == [1] * 4 and max(lengths) > 1  # <|im_end|> then padding, beside longer ones
    assert seen[0::2] == [""] * 4
