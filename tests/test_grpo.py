import copy
import json
import math

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
    # (train.seed: with the sampler of generate/, seed 0 draws one group whose 4 rewards tie, so the
    # second mini-batch has no advantage and lora_A, which only moves after B does, stays put)
    ("lora", ["rl.kl_beta=0.1", "quant.language=nf4", "precision.mode=bf16", "train.seed=1"]),
    # fp32 masters under bf16: the rollout reads bf16 copies of the linears (PrecisionPolicy.inference_weights)
    ("full", ["rl.kl_beta=0.1", "precision.mode=bf16", "train.seed=1"]),
    # fp32 masters in the optimizer (MasterWeightAdamW): the rollout reads the model's own bf16 linears
    ("full", ["rl.kl_beta=0.1", "precision.mode=bf16", "precision.master_weights=optimizer", "train.seed=1"]),
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
        captured["params"] = dict(t.model.named_parameters())
        return t

    monkeypatch.setattr(recipe, "setup_model", capture)  # a spy: keeps the real model to inspect
    run_grpo(cfg)
    t, before = captured["t"], captured["before"]
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] > 0 and row["adv_std"] > 0
    for n, p in t.model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: trainable={p.requires_grad} changed={changed}"
        assert p is captured["params"][n], n  # the optimizer's parameters (inference_weights gave them back)
    for key in ["reward_mean", "reward_std", "accuracy", "adv_mean", "kl", "clip_frac", "entropy",
                "response_length_mean", "response_length_max", "zero_var_group_frac", "time_rollout_s",
                "time_train_s", "tokens_per_s", "step_time_s", "mem/peak_rss_gb", f"reward/{tmp_path / 'rewards.py'}:varied",
                "grad_norm", "grad_norm/language", "grad_norm/projector", "grad_norm/vision", "skipped"]:
        assert key in row, key
    assert (tmp_path / "run" / "reward.png").exists()


def hand_advantages(rewards: list[float], G: int, estimator: str, lengths: list[float]) -> list[float]:
    """The estimators written out (RLOO: Ahmadian et al. 2024; REINFORCE++ and its baseline form: verl's
    masked_whiten over response tokens, token-weighted mean and Bessel-corrected variance)."""
    groups = [rewards[i:i + G] for i in range(0, len(rewards), G)]
    if estimator == "rloo":
        return [0.0 if len(set(g)) == 1 else r - (sum(g) - r) / (G - 1) for g in groups for r in g]
    x = [r - sum(g) / G for g in groups for r in g] if estimator == "reinforce++-baseline" else list(rewards)
    if len(set(x)) == 1:
        return [0.0] * len(x)
    total = sum(lengths)
    mean = sum(w * v for w, v in zip(lengths, x)) / total
    var = sum(w * (v - mean) ** 2 for w, v in zip(lengths, x)) / total * total / (total - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in x]


@pytest.mark.parametrize("loss,advantage", [("gspo", "rloo"), ("cispo", "reinforce++"), ("ppo", "reinforce++-baseline")])
def test_grpo_relatives_train_through_the_recipe(shapes_dir, tmp_path, loss, advantage, monkeypatch):
    """rl.policy_loss (GSPO, CISPO) and rl.advantage (RLOO, REINFORCE++) through the whole recipe:
    the first mini-batch is on-policy (every ratio 1), every LoRA B moves and nothing frozen does,
    and the logged advantages are the estimator's, written out by hand from the step's rewards."""
    from vlforge.recipes import grpo as recipe

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "tiers.method=lora", f"rl.policy_loss={loss}",
                      f"rl.advantage={advantage}", "rl.mini_batch_size=8", "train.seed=1")
    seen = {"kind": set(), "estimator": set(), "inputs": []}
    real_loss, real_adv = recipe.policy_loss, recipe.outcome_advantages
    monkeypatch.setattr(recipe, "policy_loss", lambda *a, **k: seen["kind"].add(k["kind"]) or real_loss(*a, **k))

    def advantages(r, g, estimator, *a, **k):  # a spy: the rewards and lengths it was given
        seen["estimator"].add(estimator)
        seen["inputs"].append((r.tolist(), g, k["lengths"].tolist()))
        return real_adv(r, g, estimator, *a, **k)
    monkeypatch.setattr(recipe, "outcome_advantages", advantages)
    captured = {}
    setup_model = recipe.setup_model

    def capture(c, **kwargs):  # a spy: keeps the real model to inspect
        t = captured["t"] = setup_model(c, **kwargs)
        captured["before"] = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return t
    monkeypatch.setattr(recipe, "setup_model", capture)
    assert cfg.rl.aggregation == ("seq-mean-token-mean" if loss == "gspo" else "token-mean")
    assert cfg.rl.clip_range == {"gspo": (3e-4, 4e-4), "cispo": (1.0, 0.2), "ppo": (0.2, 0.2)}[loss]
    run_grpo(cfg)
    assert seen["kind"] == {loss} and seen["estimator"] == {advantage}
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] == 2 and math.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and row["clip_frac"] == 0.0
    # one optimizer step from B = 0: every adapter's B moves (A gets no gradient until B is non-zero)
    moved = {n for n, p in captured["t"].model.named_parameters() if not torch.equal(captured["before"][n], p.detach())}
    lora_b = {n for n, p in captured["t"].model.named_parameters() if p.requires_grad and ".lora_B." in n}
    assert lora_b and moved == lora_b
    rewards, G, lengths = seen["inputs"][-1]  # every group kept: the step's whole batch
    assert len(rewards) == 8 and len(set(rewards)) > 1
    expected = torch.tensor(hand_advantages(rewards, G, advantage, lengths), dtype=torch.float64)
    assert row["adv_std"] == pytest.approx(float(expected.std()), rel=1e-5)
    assert row["adv_mean"] == pytest.approx(float(expected.mean()), abs=1e-6)
    assert row["adv_max"] == pytest.approx(float(expected.max()), rel=1e-5)


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


@pytest.mark.parametrize("key", ["data.packing=true", "data.max_tokens_per_batch=4096", "loss.impl=liger"])
def test_sft_only_keys_are_refused_before_loading(shapes_dir, tmp_path, key):
    from vlforge.config import ConfigError

    with pytest.raises(ConfigError, match=key.split("=")[0]):
        run_grpo(grpo_config(shapes_dir, tmp_path / "run", tmp_path, key))
    assert not (tmp_path / "run").exists()


def test_grpo_resume_equals_uninterrupted(shapes_dir, tmp_path):
    common = ["tiers.method=full", "rl.kl_beta=0.0", "train.save_every=2"]
    run_grpo(grpo_config(shapes_dir, tmp_path / "straight", tmp_path, "train.max_steps=4", *common))
    run_grpo(grpo_config(shapes_dir, tmp_path / "split", tmp_path, "train.max_steps=2", *common))
    run_grpo(grpo_config(shapes_dir, tmp_path / "split", tmp_path, "train.max_steps=4", "train.resume=auto", *common))
    a = load_file(tmp_path / "straight" / "checkpoint-4" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoint-4" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("keep", [True, False])
def test_rollout_keep_kv_frees_the_kv_slots_before_each_update(shapes_dir, tmp_path, monkeypatch, keep):
    """rollout.keep_kv=false: every update runs with the engine's KV slots freed (the next rollout
    allocates them again) and the run is the same as with them kept; true: they stay allocated."""
    from vlforge.generate.engine import engine_for
    from vlforge.recipes import grpo as recipe

    held, real = [], recipe.update

    def update(t, *args, **kwargs):  # a spy: the real update, noting the engine's buffers
        held.append(engine_for(t.model).runner.cache is not None)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(recipe, "update", update)
    common = ["tiers.method=lora", "rl.kl_beta=0.0", "train.max_steps=2"]
    run_grpo(grpo_config(shapes_dir, tmp_path / "run", tmp_path, *common, f"rollout.keep_kv={str(keep).lower()}"))
    assert held == [keep, keep]
    if not keep:  # the same steps as with the buffers kept
        run_grpo(grpo_config(shapes_dir, tmp_path / "kept", tmp_path, *common))
        rows = [[json.loads(r) for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("run", "kept")]
        for a, b in zip(*rows):
            varies = ("time_", "step_time_s", "tokens_per_s", "mem/")  # clocks and memory, run to run
            assert {k: v for k, v in a.items() if not k.startswith(varies)} == \
                {k: v for k, v in b.items() if not k.startswith(varies)}


def test_reward_functions_see_exactly_the_response_text(shapes_dir, tmp_path):
    """Completions given to rewards are the decoded response only: nothing after <|im_end|>."""
    from vlforge.data.dataset import load_dataset
    from vlforge.recipes.grpo import rollout_round
    from vlforge.train.trainable import setup_model
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


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_mini_batch_spanning_rollout_rounds_equals_one_batch(shapes_dir, tmp_path, agg):
    """Dynamic sampling keeps groups from several rounds; their mini-batches must not depend on
    which round a group came from."""
    from vlforge.data.dataset import load_dataset
    from vlforge.train.health import GradHealth
    from vlforge.train.optim import build_optimizer
    from vlforge.model.tiers import param_groups
    from vlforge.recipes.grpo import disable_dropout, rollout_round, update
    from vlforge.rollout.minibatch import Batch
    from vlforge.train.trainable import setup_model
    from vlforge.rl import RewardSpec, build_rewards, grpo_advantages

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "tiers.method=lora", "rl.kl_beta=0.1",
                      f"rl.agg={agg}", "rl.mini_batch_size=8", "rollout.prompts_per_step=2")
    rewards = build_rewards([RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in cfg.rl.rewards])
    results = []
    for split in (False, True):
        torch.manual_seed(0)  # peft draws LoRA A from the global RNG: the same model twice
        t = setup_model(cfg)
        disable_dropout(t.model)  # as run_grpo: the same forward whatever the mini-batch layout
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        torch.manual_seed(0)
        rollout, scored = rollout_round(t, data, [0, 1], cfg, rewards)
        adv = grpo_advantages(scored["reward"], 4)
        seqs = list(range(8))
        batches = [Batch(rollout, seqs[:4], adv, None), Batch(rollout, seqs[4:], adv, None)] if split \
            else [Batch(rollout, seqs, adv, None)]
        optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
        row = update(t, None, batches, optimizer, t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), cfg)
        results.append((row, {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}))
    (row_one, one), (row_split, split_) = results
    assert row_one["skipped"] == 0 and abs(row_one["loss"]) > 0
    assert row_split["loss"] == pytest.approx(row_one["loss"], rel=1e-5, abs=1e-7)
    for n in one:
        torch.testing.assert_close(split_[n], one[n], rtol=1e-5, atol=1e-6)


def test_batch_std_is_pooled_over_rollout_rounds():
    import statistics

    from types import SimpleNamespace

    from vlforge.recipes.grpo import pool_batch_statistics
    from vlforge.rollout.minibatch import Batch
    from vlforge.rl import grpo_advantages

    r1 = [0.0, 1.0, 0.0, 3.0, 9.0, 9.0, 1.0, 2.0]  # round 1: 4 groups of 2, all kept
    r2 = [5.0, 0.0, 2.0, 4.0]  # round 2: one kept group (seqs 0, 1), one dropped (seqs 2, 3)
    b1 = Batch(None, list(range(8)), grpo_advantages(torch.tensor(r1), 2, scale="batch"), None)
    b2 = Batch(None, [0, 1], grpo_advantages(torch.tensor(r2), 2, scale="batch"), None)
    round1_adv = b1.advantages.clone()
    lengths = [torch.ones(8), torch.ones(2)]
    pool_batch_statistics([b1, b2], [torch.tensor(r1), torch.tensor(r2[:2])], lengths, 2,
                          SimpleNamespace(advantage="grpo", adv_scale="batch"))

    # adv_scale=batch by hand: (r - its group's mean) / (std over every kept reward + eps), with
    # grpo_advantages' conventions: the unbiased (n - 1) std, as torch.std, and eps = 1e-6
    eps = 1e-6
    kept = r1 + r2[:2]
    pooled_std = statistics.stdev(kept)
    expected = [(r - statistics.mean(kept[i - i % 2:i - i % 2 + 2])) / (pooled_std + eps)
                for i, r in enumerate(kept)]
    torch.testing.assert_close(torch.cat([b1.advantages, b2.advantages[:2]]), torch.tensor(expected))
    assert not torch.allclose(round1_adv, torch.tensor(expected[:8]))  # round 1's own std would differ
    # the dropped group keeps its round's advantages: scaled by round 2's std of all four rewards
    round2_std = statistics.stdev(r2)
    torch.testing.assert_close(b2.advantages[2:], torch.tensor([(2.0 - 3.0) / (round2_std + eps),
                                                                (4.0 - 3.0) / (round2_std + eps)]))


@pytest.mark.parametrize("old", ["rollout", "trainer"])
def test_old_logprobs_recomputed_by_the_trainer_make_the_first_ratio_exactly_one(shapes_dir, tmp_path, old,
                                                                                 monkeypatch):
    """rl.old_logprobs=trainer: the ratio's denominator is the trainer's own no-grad forward, so a
    rollout engine whose log-probs are off (here shifted by 0.05 a token) no longer shows in the
    first mini-batch's ratio; with the rollout's, the ratio is exp(-0.05)."""
    from vlforge.recipes import grpo as recipe

    real = recipe.generate_groups

    def shifted(*args, **kwargs):
        rollout = real(*args, **kwargs)
        rollout.logprobs.add_(0.05 * rollout.response_mask.to(rollout.logprobs.dtype))
        return rollout

    monkeypatch.setattr(recipe, "generate_groups", shifted)
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "tiers.method=lora", f"rl.old_logprobs={old}",
                      "rl.mini_batch_size=8", "rl.kl_beta=0.1", "train.seed=1")
    run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    expected = 1.0 if old == "trainer" else math.exp(-0.05)
    assert row["ratio_mean"] == pytest.approx(expected, abs=1e-5)
    if old == "trainer":  # the engine's shift, seen by the recompute
        assert row["rollout_approx_kl"] == pytest.approx(0.05, abs=1e-5)
    else:
        assert "rollout_approx_kl" not in row
    assert row["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference forward ran too, before any update

def test_batch_statistics_are_over_the_kept_groups_token_weighted():
    """reinforce++ over two rounds (and one round whose other groups dynamic sampling dropped):
    whitened over the kept responses only, each weighted by its length, as verl whitens the batch it
    trains after filtering."""
    from types import SimpleNamespace

    from vlforge.recipes.grpo import pool_batch_statistics
    from vlforge.rollout.minibatch import Batch
    from vlforge.rl import outcome_advantages

    r1, r2 = torch.tensor([0.0, 1.0, 1.0, 1.0]), torch.tensor([2.0, 0.0])
    l1, l2 = torch.tensor([1.0, 5.0, 2.0, 2.0]), torch.tensor([7.0, 3.0])
    b1 = Batch(None, list(range(4)), torch.zeros(4), None)
    b2 = Batch(None, [0, 1], torch.zeros(4), None)  # round 2 also held a dropped group (rows 2, 3)
    pool_batch_statistics([b1, b2], [r1, r2], [l1, l2], 2, SimpleNamespace(advantage="reinforce++", adv_scale="group"))
    r, w = torch.cat([r1, r2]), torch.cat([l1, l2])
    mean = (w * r).sum() / w.sum()
    var = (w * (r - mean) ** 2).sum() / w.sum() * w.sum() / (w.sum() - 1)
    expected = (r - mean) / torch.sqrt(var + 1e-8)
    torch.testing.assert_close(torch.cat([b1.advantages, b2.advantages[:2]]), expected)
    assert torch.equal(b2.advantages[2:], torch.zeros(2))
    assert torch.equal(outcome_advantages(torch.ones(4), 2, "reinforce++"), torch.zeros(4))  # no spread: no signal


def test_policy_loss_settings_left_from_a_ppo_config_are_warned_about():
    from vlforge.recipes.grpo import loss_setting_warnings

    shipped = ["rl.clip_low=0.2", "rl.clip_high=0.28", "rl.agg=token-mean"]  # as configs/*-grpo.yaml
    warned = loss_setting_warnings(load_config(GRPOConfig, None, ["rl.policy_loss=gspo", *shipped]).rl)
    assert len(warned) == 2 and "3e-4 / 4e-4" in warned[0] and "mean over sequences" in warned[1]
    assert "truncates above only" in loss_setting_warnings(
        load_config(GRPOConfig, None, ["rl.policy_loss=cispo", *shipped]).rl)[0]
    for loss in ("ppo", "gspo", "cispo"):
        assert loss_setting_warnings(load_config(GRPOConfig, None, [f"rl.policy_loss={loss}"]).rl) == []


def test_a_round_with_no_prompt_left_still_draws_its_rollout_seed(shapes_dir, tmp_path):
    """Every rank draws the round's rollout seed from the global RNG, also a rank whose prompts were
    all skipped (data.on_error=skip): otherwise its RNG falls one draw behind the others' and the
    next rounds' seeds (the same on every rank by construction) differ between ranks."""
    from vlforge.data.dataset import load_dataset
    from vlforge.train.trainable import setup_model
    from vlforge.recipes.grpo import rollout_round
    from vlforge.rollout.groups import rollout_seed

    row = json.loads((shapes_dir / "train.jsonl").read_text().splitlines()[0])
    broken = tmp_path / "broken.png"  # its header reads (the row loads), its pixels do not (the round skips it)
    broken.write_bytes((shapes_dir / row["image"]).read_bytes()[:60])  # image paths are relative to the JSONL
    (tmp_path / "broken.jsonl").write_text(json.dumps({**row, "image": str(broken)}) + "\n")
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "data.on_error=skip")
    t = setup_model(cfg)
    data = load_dataset(str(tmp_path / "broken.jsonl"), t.processor, cfg.data)
    torch.manual_seed(0)
    assert rollout_round(t, data, [0], cfg, rewards=None) == (None, {})
    after_round = torch.randint(2**62, (1,))
    torch.manual_seed(0)
    rollout_seed()
    assert torch.equal(after_round, torch.randint(2**62, (1,)))
