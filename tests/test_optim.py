"""optim.name: torch AdamW vs bitsandbytes' 8-bit AdamW: refusals, state, resume, numerics."""

import sys

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import ConfigError, OptimConfig
from vlforge.engine.optim import build_optimizer, optimizer_problem, state_bytes
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

bnb = pytest.importorskip("bitsandbytes")

# full fine-tuning: most tiny tensors are >= 4096 values, so they get 8-bit state (LoRA's would not)
COMMON = ["tiers.method=full", "optim.schedule=constant", "data.val=null", "eval.every=0"]


def weights(out_dir, step):
    return load_file(out_dir / f"checkpoint-{step}" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(shapes_dir, tmp_path_factory):
    """4 uninterrupted steps of each optimizer from the same start: {name: out_dir}."""
    runs = {}
    for name in ("adamw8bit", "adamw"):
        runs[name] = tmp_path_factory.mktemp(name)
        run_sft(tiny_sft_config(shapes_dir, runs[name], *COMMON, f"optim.name={name}", "train.max_steps=4"))
    return runs


def test_optimizer_problem_refuses_before_loading(monkeypatch):
    assert optimizer_problem(OptimConfig(), "mps", sharded=True) is None  # torch AdamW runs everywhere
    assert optimizer_problem(OptimConfig(name="adamw8bit"), "cpu", sharded=False) is None
    assert optimizer_problem(OptimConfig(name="paged_adamw8bit"), "cuda", sharded=False) is None
    assert "needs CUDA" in optimizer_problem(OptimConfig(name="paged_adamw8bit"), "cpu", sharded=False)
    assert "no 8-bit optimizer kernels for mps" in optimizer_problem(OptimConfig(name="adamw8bit"), "mps", False)
    assert "FSDP2" in optimizer_problem(OptimConfig(name="adamw8bit"), "cuda", sharded=True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it looks like
    assert "pip install 'vlforge[quant]'" in optimizer_problem(OptimConfig(name="adamw8bit"), "cpu", False)


def test_paged_on_cpu_is_refused_before_the_model_loads(shapes_dir, tmp_path, monkeypatch):
    import vlforge.engine.trainable as trainable

    monkeypatch.setattr(trainable, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="paged_adamw8bit pages optimizer state.*needs CUDA"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path, "optim.name=paged_adamw8bit"))


def test_8bit_state_is_uint8_and_tier_lrs_reach_the_groups(shapes_dir, tmp_path):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.engine.losses import sft_loss_sum
    from vlforge.engine.trainable import setup_model
    from vlforge.model.tiers import param_groups

    # vision lr 0: its weights must not move at all (nor decay), while the other tiers do
    cfg = tiny_sft_config(shapes_dir, tmp_path, "tiers.method=full", "optim.name=adamw8bit", "optim.weight_decay=0.1",
                          "tiers.language.lr=1e-3", "tiers.projector.lr=5e-4", "tiers.vision.lr=0")
    t = setup_model(cfg)
    groups = param_groups(t.model, t.plan, cfg.optim.weight_decay)
    opt = build_optimizer(groups, cfg.optim, t.device.type)
    assert type(opt) is bnb.optim.AdamW8bit
    got = [(g["tier"], g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    assert got == [(g["tier"], g["lr"], g["weight_decay"], len(g["params"])) for g in groups]
    assert {g["tier"]: g["lr"] for g in opt.param_groups} == {"language": 1e-3, "projector": 5e-4, "vision": 0}

    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    data = load_dataset(cfg.data.train, t.processor, cfg.data)
    loss, _ = sft_loss_sum(t.model, collate([data[i] for i in range(4)], data.encoder.pad_id))
    loss.backward()
    opt.step()
    tier = {id(p): g["tier"] for g in opt.param_groups for p in g["params"]}
    total = eight_bit = 0
    for n, p in t.model.named_parameters():
        if not p.requires_grad:
            continue
        state = opt.state[p]
        moments = [state["state1"], state["state2"]]
        nbytes = sum(x.numel() * x.element_size() for x in moments + [state.get("absmax1"), state.get("absmax2")]
                     if x is not None)
        assert nbytes == state_bytes(p.numel(), "adamw8bit"), n
        if p.numel() >= 4096:
            assert all(m.dtype == torch.uint8 for m in moments), n
            eight_bit += p.numel()
        total += p.numel()
        moved = not torch.equal(p.detach(), before[n])
        assert moved == (tier[id(p)] != "vision"), n
    assert eight_bit / total > 0.9
    per_param = sum(state_bytes(p.numel(), "adamw8bit") for p in t.model.parameters() if p.requires_grad) / total
    assert per_param < 2.3 < 8 == sum(state_bytes(p.numel(), "adamw") for p in t.model.parameters()
                                      if p.requires_grad) / total


def test_adamw8bit_resume_is_bit_identical(shapes_dir, tmp_path, straight):
    run = lambda steps, *extra: run_sft(tiny_sft_config(shapes_dir, tmp_path, *COMMON, "optim.name=adamw8bit",
                                                        f"train.max_steps={steps}", *extra))
    run(2)
    saved = torch.load(tmp_path / "checkpoint-2" / "optimizer.pt", weights_only=True)["state"]
    quant = [s["__bnb_optimizer_quant_state__"] for s in saved.values()]
    assert any(q["state1"].dtype == torch.uint8 for q in quant)  # the 8-bit state itself is what is saved
    run(4, "train.resume=auto")
    a, b = weights(straight["adamw8bit"], 4), weights(tmp_path, 4)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_adamw8bit_moves_the_weights_like_adamw(shapes_dir, tmp_path, straight):
    from vlforge.engine.trainable import setup_model

    start = {n: p.detach() for n, p in setup_model(tiny_sft_config(shapes_dir, tmp_path,
                                                                   "tiers.method=full")).model.named_parameters()}
    w8, w32 = weights(straight["adamw8bit"], 4), weights(straight["adamw"], 4)
    d8 = torch.cat([(w8[n] - start[n]).flatten() for n in w8])
    d32 = torch.cat([(w32[n] - start[n]).flatten() for n in w8])
    cos = torch.nn.functional.cosine_similarity(d8, d32, dim=0).item()
    assert cos > 0.9, cos  # same direction...
    assert not torch.equal(d8, d32)  # ...but quantized moments, so not the same numbers


def test_8bit_adamw_refuses_fsdp2_parameters(tmp_path):
    """The fact the FSDP2 refusal rests on: bitsandbytes' 8-bit step fails on DTensor parameters.
    If a bitsandbytes release lifts that, this test fails: then allow optim.name=adamw8bit with FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 64)
        fully_shard(model)
        with pytest.raises(ConfigError, match="does not work under FSDP2"):
            build_optimizer([{"params": list(model.parameters()), "lr": 1e-3, "weight_decay": 0.0}],
                            OptimConfig(name="adamw8bit"), "cpu")
        raw = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
        model(torch.randn(4, 128)).sum().backward()
        with pytest.raises(RuntimeError, match="DTensor"):
            raw.step()
    finally:
        dist.destroy_process_group()


def test_adamw_on_local_shards_equals_adamw_through_dtensor(tmp_path, monkeypatch):
    """ShardLocalAdamW (build_optimizer's adamw) updates FSDP2's DTensor parameters exactly as
    torch's AdamW through DTensor dispatch does, and keeps its state DTensors (DCP saves them
    sharded and reshards them on another world size)."""
    import torch.distributed as dist
    import torch.optim.adam as adam_module
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vlforge.engine.optim import ShardLocalAdamW

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
            fully_shard(model[0])
            models.append(fully_shard(model))

        def groups(m):  # two tiers, each its own lr and weight decay
            return [{"params": list(m[0].parameters()), "lr": 1e-2, "weight_decay": 0.1},
                    {"params": list(m[2].parameters()), "lr": 3e-3, "weight_decay": 0.0}]
        ours = build_optimizer(groups(models[0]), OptimConfig(name="adamw"), "cpu")
        reference = torch.optim.AdamW(groups(models[1]), betas=ours.defaults["betas"], eps=ours.defaults["eps"])
        assert isinstance(ours, ShardLocalAdamW)
        kernel_inputs, real_adam = [], adam_module.adam

        def adam(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs):  # what the update kernel gets
            kernel_inputs.append({type(t) for t in (*params, *grads, *exp_avgs, *exp_avg_sqs)})
            return real_adam(params, grads, exp_avgs, exp_avg_sqs, *args, **kwargs)
        monkeypatch.setattr(adam_module, "adam", adam)
        initial = {n: p.full_tensor().clone() for n, p in models[0].named_parameters()}
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            for model, opt in zip(models, (ours, reference)):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert isinstance(p, DTensor)
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-6, atol=1e-7, msg=name)
            assert not torch.equal(p.full_tensor(), initial[name]), f"{name} never moved"
        # ours hands the kernel plain local shards (the speed-up: no DTensor dispatch); torch's, DTensors
        # per step: ours (two groups, two calls), then torch's (two calls)
        assert [kernel_inputs[i] for i in range(12) if i % 4 < 2] == [{torch.Tensor}] * 6
        assert [kernel_inputs[i] for i in range(12) if i % 4 >= 2] == [{DTensor}] * 6
        state = ours.state[next(models[0].parameters())]
        assert isinstance(state["exp_avg"], DTensor) and isinstance(state["exp_avg_sq"], DTensor)
        assert int(state["step"]) == 3
    finally:
        dist.destroy_process_group()
