"""optim.name: torch AdamW vs bitsandbytes' 8-bit AdamW: refusals, state, resume, numerics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import ConfigError, OptimConfig
from vlforge.train.optim import build_optimizer, optimizer_problem, state_bytes
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
    assert optimizer_problem(OptimConfig(), "mps") is None  # torch AdamW runs everywhere
    assert optimizer_problem(OptimConfig(name="adamw8bit"), "cpu") is None
    assert optimizer_problem(OptimConfig(name="paged_adamw8bit"), "cuda") is None
    assert "needs CUDA" in optimizer_problem(OptimConfig(name="paged_adamw8bit"), "cpu")
    assert "no 8-bit optimizer kernels for mps" in optimizer_problem(OptimConfig(name="adamw8bit"), "mps")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it looks like
    assert "pip install 'vlforge[quant]'" in optimizer_problem(OptimConfig(name="adamw8bit"), "cpu")


def test_paged_on_cpu_is_refused_before_the_model_loads(shapes_dir, tmp_path, monkeypatch):
    import vlforge.train.trainable as trainable

    monkeypatch.setattr(trainable, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="paged_adamw8bit pages optimizer state.*needs CUDA"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path, "optim.name=paged_adamw8bit"))


def test_8bit_state_is_uint8_and_tier_lrs_reach_the_groups(shapes_dir, tmp_path):
    from vlforge.data.dataset import load_dataset
    from vlforge.data.encode import collate
    from vlforge.train.losses import sft_loss_sum
    from vlforge.train.trainable import setup_model
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
    from vlforge.train.trainable import setup_model

    start = {n: p.detach() for n, p in setup_model(tiny_sft_config(shapes_dir, tmp_path,
                                                                   "tiers.method=full")).model.named_parameters()}
    w8, w32 = weights(straight["adamw8bit"], 4), weights(straight["adamw"], 4)
    d8 = torch.cat([(w8[n] - start[n]).flatten() for n in w8])
    d32 = torch.cat([(w32[n] - start[n]).flatten() for n in w8])
    cos = torch.nn.functional.cosine_similarity(d8, d32, dim=0).item()
    assert cos > 0.9, cos  # same direction...
    assert not torch.equal(d8, d32)  # ...but quantized moments, so not the same numbers


def test_8bit_adamw_on_fsdp2_shards_resumes_exactly_on_any_world_size(tmp_path):
    """bitsandbytes' 8-bit AdamW on FSDP2's shards (optim.sharded_8bit; torchrun, gloo): tensors whose
    rows are whole 256-value blocks keep 8-bit moments, quantized as bitsandbytes quantizes them on
    one unsharded process (one of them a single row, which rank 1 holds none of); the rest keep fp32
    moments. The state saved through DCP on 2 ranks resumes exactly on 2, and on 1 (resharded) to
    the 2-rank run within float noise; 1 rank trains as 2 do."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    probe = str(Path(__file__).parent / "fsdp2_8bit_probe.py")

    def launch(nproc: int, tag: str, *args) -> dict:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", probe, str(tmp_path), tag, *map(str, args)],
                                env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        return torch.load(tmp_path / f"{tag}.pt", weights_only=True)

    two = launch(2, "two", 4, 2)
    saved = str(tmp_path / "two-dcp")
    runs = {"two-resumed": launch(2, "two-resumed", 4, 0, saved), "one-resumed": launch(1, "one-resumed", 4, 0, saved),
            "one": launch(1, "one", 4), "plain": launch(1, "plain", 2)}
    eight_bit = {"0.weight", "3.weight"}  # 256- and 4096-wide rows; 1.weight's are 37 wide
    assert two["moments"] == {n: torch.uint8 if n in eight_bit else torch.float32 for n in two["moments"]}
    assert runs["plain"]["moments"]["1.weight"] == torch.uint8  # bitsandbytes quantizes it unsharded

    final = two["weights"][-1]
    for name, w in final.items():
        assert torch.equal(runs["two-resumed"]["weights"][-1][name], w), name  # the same shards: exact
        torch.testing.assert_close(runs["one-resumed"]["weights"][-1][name], w, rtol=0, atol=1e-6, msg=name)
        # one process sums the gradient in another order than two ranks' reduction: a moment element near an
        # 8-bit code boundary may round to the neighbouring code and move its weight by a fraction of lr (seen
        # on one of two x86 machines: 1 of 9,472 values 1.6e-4 off); every other value within float noise
        one = runs["one"]["weights"][-1][name]
        torch.testing.assert_close(one, w, rtol=0, atol=1e-3, msg=name)
        assert ((one - w).abs() > 1e-5).float().mean() <= 1e-3, name
    # after 2 steps (the first step's update does not depend on how the moments are stored): the
    # 8-bit tensors as bitsandbytes unsharded, the fp32-moment one not
    plain, one = runs["plain"]["weights"][1], runs["one"]["weights"][1]
    for name in eight_bit:
        torch.testing.assert_close(one[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert (one["1.weight"] - plain["1.weight"]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_8bit_adamw_under_fsdp2_on_cuda_resumes_exactly(shapes_dir, tmp_path, name):
    """bitsandbytes' CUDA kernels on FSDP2 shards (one process), bf16 compute: 2 steps, saved, resumed
    to 3 give the uninterrupted 3 steps' losses exactly, and train as the unsharded 8-bit run does
    (the mergers' 8-bit moments quantized alike; the fp32-moment tensors differ within 8-bit noise)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run = lambda out, steps, *extra: run_sft(tiny_sft_config(  # noqa: E731
        shapes_dir, out, *COMMON, f"optim.name={name}", "train.device=cuda", "precision.mode=bf16",
        "compile.enabled=false", f"train.max_steps={steps}", *extra))  # the optimizer, eager: compiling takes ~90 s
    losses = lambda out: [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                          if "loss" in json.loads(x)]
    sharded = "distributed.strategy=fsdp2"
    run(tmp_path / "straight", 3, sharded)
    run(tmp_path / "resumed", 2, sharded)
    run(tmp_path / "resumed", 3, sharded, "train.resume=auto")
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    run(tmp_path / "plain", 3)
    assert losses(tmp_path / "plain") == pytest.approx(losses(tmp_path / "straight"), rel=2e-2)


def test_8bit_state_of_a_sharded_tensor_is_saved_as_dtensors_shaped_like_it(tmp_path):
    """What DCP sees of the 8-bit state under FSDP2: the codes shaped and placed as the parameter, the
    block scales as (rows, blocks per row), the step a plain tensor; loaded back, the same state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(512, 24)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))  # the CPU, also where a GPU is visible
        opt = build_optimizer([{"params": list(model.parameters()), "lr": 1e-3, "weight_decay": 0.0}],
                              OptimConfig(name="adamw8bit"), "cpu")
        assert type(opt).__name__ == "ShardedAdamW8bit" and isinstance(opt, bnb.optim.AdamW8bit)
        for _ in range(2):
            model(torch.randn(4, 512)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        weight, bias = saved["state"][0], saved["state"][1]
        assert isinstance(weight["state1"], DTensor) and weight["state1"].shape == (24, 512)
        assert weight["state1"].dtype == torch.uint8 and weight["state1"].placements == model.weight.placements
        assert weight["absmax2"].shape == (24, 2) and weight["absmax2"].dtype == torch.float32
        assert float(weight["step"]) == 2 and "qmap1" not in weight
        assert bias["state1"].dtype == torch.float32 and "absmax1" not in bias  # 24 values: fp32 moments
        before = {k: v.clone() for k, v in opt.state[model.weight].items() if torch.is_tensor(v)}
        opt.state.clear()
        opt.load_state_dict(saved)
        after = opt.state[model.weight]
        assert after["step"] == 2 and before.keys() <= after.keys()
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        assert optimizer_problem(OptimConfig(name="adamw8bit"), "cuda") is None  # FSDP2 or not
    finally:
        dist.destroy_process_group()


def test_adamw_on_local_shards_equals_adamw_through_dtensor(tmp_path, monkeypatch):
    """ShardLocalAdamW (build_optimizer's adamw) updates FSDP2's DTensor parameters exactly as
    torch's AdamW through DTensor dispatch does, and keeps its state DTensors (DCP saves them
    sharded and reshards them on another world size)."""
    import torch.distributed as dist
    import torch.optim.adam as adam_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vlforge.train.optim import ShardLocalAdamW

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
            mesh = init_device_mesh("cpu", (1,))  # the CPU, also where a GPU is visible
            fully_shard(model[0], mesh=mesh)
            models.append(fully_shard(model, mesh=mesh))

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
