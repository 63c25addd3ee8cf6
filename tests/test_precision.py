import math

import pytest
import torch

from vlforge.config import PrecisionConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.engine.health import GradHealth
from vlforge.engine.optim import build_optimizer
from vlforge.engine.precision import PrecisionPolicy
from vlforge.model.tiers import param_groups
from vlforge.recipes.sft import setup_model, train_step

from helpers import tiny_sft_config


@pytest.mark.parametrize("mode,frozen", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_policy_storage_dtypes_and_a_finite_step(shapes_dir, tmp_path, mode, frozen):
    cfg = tiny_sft_config(shapes_dir, tmp_path, f"precision.mode={mode}", "tiers.method=lora")
    t = setup_model(cfg)
    for name, p in t.model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else frozen), name  # fp32 master weights
    assert t.policy.uses_loss_scaling == (mode == "fp16")
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    optimizer_state_dtypes = set()
    result = train_step(t, [collate([data[i] for i in range(4)], data.encoder.pad_id)], optimizer,
                        t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), 1.0)
    assert math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"])
    for state in optimizer.state.values():
        optimizer_state_dtypes |= {state["exp_avg"].dtype, state["exp_avg_sq"].dtype}
    assert optimizer_state_dtypes == {torch.float32}


def test_bf16_loss_is_close_to_fp32(shapes_dir, tmp_path):
    from vlforge.engine.losses import sft_loss_sum

    losses = {}
    for mode in ("fp32", "bf16"):
        cfg = tiny_sft_config(shapes_dir, tmp_path / mode, f"precision.mode={mode}", "tiers.method=full")
        t = setup_model(cfg)
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        batch = collate([data[i] for i in range(8)], data.encoder.pad_id)
        with torch.no_grad(), t.policy.autocast():
            loss, n = sft_loss_sum(t.model, batch)
        assert loss.dtype == torch.float32  # the loss is computed in fp32 whatever the compute dtype
        losses[mode] = float(loss) / n
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_non_finite_gradient_never_reaches_the_weights(shapes_dir, tmp_path):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "precision.mode=fp32", "tiers.method=full")
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    hook = t.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    result = train_step(t, [collate([data[i] for i in range(4)], data.encoder.pad_id)], optimizer,
                        t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), 1.0)
    hook.remove()
    assert result["skipped"] and not math.isfinite(result["grad_norm"])
    for n, p in t.model.named_parameters():
        assert torch.equal(before[n], p.detach()), n


def test_autocast_is_off_for_fp32():
    with PrecisionPolicy(PrecisionConfig(mode="fp32"), "cpu").autocast():
        assert not torch.is_autocast_enabled("cpu")
    with PrecisionPolicy(PrecisionConfig(mode="bf16"), "cpu").autocast():
        assert torch.is_autocast_enabled("cpu")
