import math
import random

import pytest
import torch

from vlforge.config import HealthConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.train.health import GradHealth, LossSpikes, TrainingDiverged, clip_to, grad_norms
from vlforge.train.optim import build_optimizer
from vlforge.model.tiers import param_groups
from vlforge.train.trainable import setup_model
from vlforge.recipes.sft import train_step

from helpers import tiny_sft_config


def _setup(shapes_dir, tmp_path, *overrides):
    cfg = tiny_sft_config(shapes_dir, tmp_path, "tiers.method=lora", *overrides)
    t = setup_model(cfg)
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    optimizer = build_optimizer(param_groups(t.model, t.plan, 0.0), cfg.optim, "cpu")
    batch = [collate([data[i] for i in range(4)], data.encoder.pad_id)]
    return cfg, t, optimizer, batch


def test_per_group_norms_add_up_to_the_global_norm(shapes_dir, tmp_path):
    cfg, t, optimizer, batch = _setup(shapes_dir, tmp_path)
    row = train_step(t, batch, optimizer, t.policy.grad_scaler(), GradHealth(t.model, t.plan, cfg.health), None)
    groups = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("grad_norm/")}
    assert set(groups) == {"language", "projector", "vision"}
    assert all(v > 0 for v in groups.values())
    assert row["grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in groups.values())), rel=1e-6)


def test_group_norms_in_fp32_and_a_group_without_gradients_is_zero():
    """Norms of bf16 gradients are taken in fp32 (a bf16 norm is 0.4% off at 10k elements); a group
    this step gave no gradient (the vision tower on a text-only step) is 0; inf propagates; the clip
    scales every gradient by max_norm / total."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.zeros(10_000, dtype=torch.bfloat16))
    a.grad = torch.randn(10_000).to(torch.bfloat16)
    b = torch.nn.Parameter(torch.zeros(3))
    c = torch.nn.Parameter(torch.zeros(2))
    c.grad = torch.tensor([3.0, 4.0])
    norms = grad_norms({"bf16": [a], "empty": [b], "fp32": [c]})
    assert norms["bf16"] == pytest.approx(a.grad.double().norm().item(), rel=1e-5)  # bf16: ~1e-3 off
    assert norms["empty"] == 0.0 and norms["fp32"] == pytest.approx(5.0)
    before = a.grad.double().clone()
    clip_to([a, b, c], 1.0, 10.0)
    torch.testing.assert_close(c.grad, torch.tensor([0.3, 0.4]))
    torch.testing.assert_close(a.grad.double(), before * 0.1, rtol=1e-2, atol=0)
    c.grad[0] = float("inf")
    assert math.isinf(grad_norms({"fp32": [c]})["fp32"])


def test_fused_adamw_takes_the_clip_in_its_update(monkeypatch):
    """With torch's fused AdamW and no loss scaler the clip rides in the optimizer's kernel
    (grad_scale): no pass of its own over the gradients, the same update as clip_to then step (to
    fp32 rounding: a division by the inverted multiplier), nothing left on the optimizer. fp16's
    scaler and non-fused optimizers keep clip_to."""
    from vlforge.train import health as health_module

    def run(fused: bool, scaler_on: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        # eps of the gradients' size: Adam's update then depends on their scale (with a tiny eps it hardly would)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.1, fused=fused,
                                      foreach=None if fused else True)
        health = GradHealth(model, [], HealthConfig())
        scaler = torch.amp.GradScaler("cpu", enabled=scaler_on)
        for _ in range(3):
            scaler.scale(100 * model(torch.randn(8, 16)).square().sum()).backward()  # norm >> 1: clipped
            row = health.step(optimizer, scaler, 1.0, 1.0)
            assert row["grad_norm"] > 10 and not row["skipped"] and not hasattr(optimizer, "grad_scale")
        return [p.detach().clone() for p in model.parameters()]

    clipped_by = []
    real_clip_to = health_module.clip_to
    monkeypatch.setattr(health_module, "clip_to", lambda *a: (clipped_by.append(a), real_clip_to(*a)))
    folded = run(fused=True, scaler_on=False)
    assert clipped_by == []  # the clip went into the optimizer
    reference = run(fused=False, scaler_on=False)
    assert len(clipped_by) == 3
    for a, b in zip(folded, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(health_module, "clips_in_optimizer", lambda *a: False)
    monkeypatch.setattr(health_module, "clip_to", lambda *a: None)  # no clip at all: another update (the test can fail)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(folded, run(fused=True, scaler_on=False)))
    monkeypatch.undo()
    monkeypatch.setattr(health_module, "clip_to", lambda *a: (clipped_by.append(a), real_clip_to(*a)))
    clipped_by.clear()
    run(fused=True, scaler_on=True)  # the fp16 scaler sets grad_scale itself: clip_to
    assert len(clipped_by) == 3


def test_nan_gradient_is_skipped_named_and_aborts_after_k_steps(shapes_dir, tmp_path):
    cfg, t, optimizer, batch = _setup(shapes_dir, tmp_path, "health.max_bad_steps=2")
    health = GradHealth(t.model, t.plan, cfg.health)
    projector = next(p for n, p in t.model.named_parameters() if "merger" in n and p.requires_grad)
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    hook = projector.register_hook(lambda g: g * float("nan"))
    row = train_step(t, batch, optimizer, t.policy.grad_scaler(), health, 1.0)
    assert row["skipped"] and row["nonfinite_groups"] == ["projector"]
    assert math.isfinite(row["grad_norm/language"]) and not math.isfinite(row["grad_norm/projector"])
    for n, p in t.model.named_parameters():
        assert torch.equal(before[n], p.detach()), n  # nothing moved, not even the healthy groups
    with pytest.raises(TrainingDiverged, match=r"2 consecutive steps.*projector"):
        train_step(t, batch, optimizer, t.policy.grad_scaler(), health, 1.0)
    hook.remove()


def test_a_good_step_resets_the_bad_streak(shapes_dir, tmp_path):
    cfg, t, optimizer, batch = _setup(shapes_dir, tmp_path, "health.max_bad_steps=2")
    health = GradHealth(t.model, t.plan, cfg.health)
    param = next(p for p in t.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("inf"))
    assert train_step(t, batch, optimizer, t.policy.grad_scaler(), health, 1.0)["skipped"]
    hook.remove()
    assert not train_step(t, batch, optimizer, t.policy.grad_scaler(), health, 1.0)["skipped"]
    assert health.bad_streak == 0


def test_loss_spike_is_reported_against_the_recent_median(capsys):
    model = torch.nn.Linear(4, 4)
    health = GradHealth(model, [], HealthConfig(spike_factor=3.0, spike_window=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rows = []
    for loss in [1.0, 1.2, 0.9, 1.1, 1.0, 5.0, 1.0]:
        model(torch.ones(1, 4)).sum().backward()
        rows.append(health.step(optimizer, scaler, 1.0, loss))
    assert [("loss_spike" in r) for r in rows] == [False] * 5 + [True, False]
    assert rows[5]["loss_spike"] == pytest.approx(5.0 / 1.05)
    assert set(health.groups) == {"other"}  # params outside any tier still get a group
    assert "loss spike" in capsys.readouterr().err
    quiet = GradHealth(model, [], HealthConfig(spike_factor=3.0, spike_window=4, spike_min_rise=1.0))
    for loss in [0.01, 0.012, 0.009, 0.011, 0.05]:  # 5x the median, but converged noise
        model(torch.ones(1, 4)).sum().backward()
        assert "loss_spike" not in quiet.step(optimizer, scaler, 1.0, loss)


def test_spike_check_survives_zero_and_negative_losses_and_can_be_off():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for spikes in (True, False):
        health = GradHealth(model, [], HealthConfig(spike_window=3), spikes=spikes)
        for loss in [0.0, 0.0, -0.5, 0.0, 2.0, -1.0]:  # GRPO-like: a zero median, then a jump
            model(torch.ones(1, 4)).sum().backward()
            assert "loss_spike" not in health.step(optimizer, scaler, 1.0, loss)


def _healthy_losses(steps: int = 1500) -> list[float]:
    """A healthy small-batch SFT loss curve, shaped like the demo recipe's: from 6.4 down to ~0.002,
    multiplicative noise, and now and then a hard sample lifting one batch by up to 0.8 nats."""
    rng = random.Random(0)
    losses = []
    for t in range(steps):
        loss = (0.002 + 6.4 * math.exp(-t / 80)) * math.exp(rng.gauss(0, 0.25))
        if rng.random() < 0.03:
            loss += rng.uniform(0.1, 0.8)
        losses.append(loss)
    return losses


def _spike_steps(losses: list[float], cfg: HealthConfig = HealthConfig()) -> list[int]:
    spikes = LossSpikes(cfg)
    return [step for step, loss in enumerate(losses) if spikes(loss) is not None]


def test_healthy_noisy_loss_curve_gives_no_spike_warning():
    losses = _healthy_losses()
    assert _spike_steps(losses) == []
    # the ratio alone would have warned many times on it (what the demo printed before)
    assert len(_spike_steps(losses, HealthConfig(spike_min_rise=0.0))) > 20


@pytest.mark.parametrize("step, make_spike", [(150, lambda loss: 10 * loss),  # 10x mid-run
                                              (1200, lambda loss: 3.0)])  # back to half the first loss
def test_injected_loss_spike_gives_exactly_one_warning(step, make_spike):
    losses = _healthy_losses()
    losses[step] = make_spike(losses[step])
    assert _spike_steps(losses) == [step]
