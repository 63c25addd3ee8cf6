"""NF4 MoE experts (quant.experts, model/quant.quantize_experts) on CPU with the tiny-moe preset:
bitsandbytes' own blocks, every experts kernel, expert LoRA on them, QLoRA training and serving."""

import json
from pathlib import Path

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from peft import get_peft_model_state_dict
from PIL import Image

from vlforge.config import ConfigError, DataConfig, ModelConfig, QuantConfig, SFTConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate
from vlforge.model.load import load_model
from vlforge.model.moe_lora import experts_base
from vlforge.model.nf4 import routed_expert_weights
from vlforge.model.quant import EXPERT_WEIGHTS, expert_modules, expert_state_bytes, verify
from vlforge.model.tiers import apply_plan, build_plan
from vlforge.infer.model import Request

from helpers import tiny_sft_config


@pytest.fixture(scope="module")
def batch(tiny_moe, shapes_dir):
    data = load_dataset(str(shapes_dir / "val.jsonl"), tiny_moe[1], DataConfig())
    return {k: v for k, v in collate([data[i] for i in range(3)], data.encoder.pad_id).items() if k != "labels"}


def _experts(model):
    return list(expert_modules(model).values())


@pytest.mark.parametrize("kernel", ["eager", "batched_mm", "grouped_mm"])
def test_nf4_experts_are_bitsandbytes_blocks_and_run_every_kernel(batch, kernel):
    """Each [E, out, in] stack holds exactly bitsandbytes' NF4 of the bf16 weight (64-value blocks,
    double-quantized scales, as Linear4bit), packed two values a byte; the model computes exactly
    what the bf16 model holding those values computes, on each of transformers' expert kernels."""
    cfg = ModelConfig(preset="tiny-moe", experts_implementation=kernel)
    q = QuantConfig(experts="nf4")  # the experts alone, so the rest is identical to the plain model
    model, _ = load_model(cfg, dtype=torch.bfloat16, quant=q)
    plain, _ = load_model(cfg, dtype=torch.bfloat16)
    report = verify(model, q)
    assert report["linears"]["experts:nf4"] == 4 and report["linears"]["language:none"] == 8
    with torch.no_grad():
        bf16 = plain(**batch).logits
        for quantized, reference in zip(_experts(model), _experts(plain)):
            for name in EXPERT_WEIGHTS:
                weight = getattr(reference, name)
                # flat: bitsandbytes 0.50's CPU kernel gets the blocks of a [..., 32] shape wrong
                # (model/nf4.dequantize_flat)
                packed, state = bnb_functional.quantize_4bit(weight.data.flatten(), blocksize=64,
                                                             compress_statistics=True, quant_type="nf4")
                nf4 = bnb_functional.dequantize_4bit(packed, state).view(weight.shape)
                assert torch.equal(getattr(quantized, name), nf4)
                stored = quantized.parametrizations[name].original
                assert stored.dtype == torch.uint8 and stored.numel() == weight.numel() // 2
                # NF4's error on a normal weight is ~0.092 (down_proj through the CPU kernel's shape bug: 0.40)
                assert 0.05 < (nf4 - weight).float().norm() / weight.float().norm() < 0.1
                weight.copy_(nf4)
        torch.testing.assert_close(model(**batch).logits, plain(**batch).logits, rtol=0, atol=0)
        assert (model(**batch).logits - bf16).abs().max() > 0  # quantization changed something
    # gradients reach the layers below through the NF4 experts (what attention-only QLoRA trains), as
    # through bf16 experts holding the same values
    grads = []
    for m in (model, plain):
        m.model.language_model.embed_tokens.weight.requires_grad_(True)
        m(**batch).logits.float().square().mean().backward()
        grads.append(m.model.language_model.embed_tokens.weight.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    plain_bytes = sum(t.numel() * t.element_size() for t in [*plain.parameters(), *plain.buffers()])
    expert_bf16 = sum(getattr(e, w).numel() * 2 for e in _experts(plain) for w in EXPERT_WEIGHTS)
    assert round(report["weights_gb"] * 1e9) == plain_bytes - expert_bf16 // 4 * 3 + expert_state_bytes(model)
    # the scales: an 8-bit absmax per 64 values and its fp32 scale per 256 absmaxes (+ two code books)
    assert 0 < expert_state_bytes(model) - expert_bf16 / 2 / 64 < 2 * 4 * 16 * 4 + 4 * 256 * 4


def test_decode_steps_dequantize_only_the_routed_experts(monkeypatch):
    """At most half as many routed (token, expert) pairs as experts (a decode step): each NF4 stack dequantizes
    the pairs' experts only, gathering their blocks and scales, and the output equals transformers'
    forward on the whole dequantized stack; a prefill still dequantizes the stack once."""
    cfg = ModelConfig(preset="tiny-moe", experts_implementation="batched_mm")
    model, _ = load_model(cfg, dtype=torch.bfloat16, quant=QuantConfig(experts="nf4"))
    experts = _experts(model)[1]
    many = torch.tensor([3, 0, 7, 3, 5, 3])  # with repeats
    for name in EXPERT_WEIGHTS:
        assert torch.equal(routed_expert_weights(experts, name, many), getattr(experts, name)[many])
    ids = torch.tensor([[3, 0], [7, 3]])  # 2 tokens, top-2: 4 pairs over 3 of the 8 experts
    torch.manual_seed(0)
    hidden, weights = torch.randn(2, 64, dtype=torch.bfloat16), torch.rand(2, 2, dtype=torch.bfloat16)
    shapes = []
    dequantize = bnb_functional.dequantize_4bit
    monkeypatch.setattr(bnb_functional, "dequantize_4bit",
                        lambda A, state, *a, **kw: shapes.append(tuple(state.shape)) or dequantize(A, state, *a, **kw))
    routed = experts(hidden, ids, weights)
    assert shapes == [(4 * 64 * 64,), (4 * 64 * 32,)]  # values of the pairs' experts, not all 8
    shapes.clear()
    whole = type(experts).forward(experts, hidden, ids, weights)  # transformers' batched_mm on the whole stacks
    assert shapes == [(8 * 64 * 64,), (8 * 64 * 32,)]
    torch.testing.assert_close(routed, whole, rtol=0, atol=0)
    shapes.clear()
    experts(torch.randn(3, 64, dtype=torch.bfloat16), torch.randint(0, 8, (3, 2)),
            torch.rand(3, 2, dtype=torch.bfloat16))
    assert shapes == [(8 * 64 * 64,), (8 * 64 * 32,)]  # 6 pairs (> 8 / 2): the whole stacks, once each


def _tiers(*overrides):
    return load_config(SFTConfig, None, ["tiers.vision.train=true", *overrides]).tiers


def _with_expert_lora(base):
    torch.manual_seed(1)
    peft_model = apply_plan(base, build_plan(base, _tiers("tiers.language.experts=true")))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter: B starts at zero
    return peft_model


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
def test_expert_lora_on_nf4_experts_equals_lora_on_their_values(batch, kernel):
    """The fused expert LoRA reads the dequantized stack: outputs and every adapter gradient equal
    those of the same adapters on bf16 experts holding the NF4 values. The adapters are put on
    before the experts are quantized (load_model's wrap), so their saved names are the bf16 run's."""
    cfg = ModelConfig(preset="tiny-moe", experts_implementation=kernel)
    model, _ = load_model(cfg, dtype=torch.bfloat16, quant=QuantConfig(experts="nf4"), wrap=_with_expert_lora)
    reference, _ = load_model(cfg, dtype=torch.bfloat16, wrap=_with_expert_lora)
    assert set(get_peft_model_state_dict(model)) == set(get_peft_model_state_dict(reference))
    with torch.no_grad():
        for quantized, plain in zip(_experts(model), _experts(reference)):  # the modules under peft's wrappers
            for name in EXPERT_WEIGHTS:
                getattr(plain, name).copy_(getattr(quantized, name))
    outputs = []
    for m in (model, reference):
        logits = m.eval()(**batch).logits  # no LoRA dropout: the same arithmetic in both
        logits.float().square().mean().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=0)
    assert outputs[0][1].keys() == outputs[1][1].keys()
    assert sum("experts" in n for n in outputs[0][1]) == 8  # A and B of both stacks in both layers
    for name, grad in outputs[0][1].items():
        torch.testing.assert_close(grad, outputs[1][1][name], rtol=0, atol=0)
        assert grad.abs().max() > 0, name


def test_expert_lora_on_a_decode_step_of_nf4_experts_gathers_only_the_routed_ones(monkeypatch):
    """A decode-sized call on the fused expert LoRA (2 tokens, 4 pairs of 8 experts): the NF4 model's
    routed path (gathered weights and adapters) equals the bf16 model holding the NF4 values, whose
    batched_mm gathers the same pairs, output and adapter gradients."""
    cfg = ModelConfig(preset="tiny-moe", experts_implementation="batched_mm")
    model, _ = load_model(cfg, dtype=torch.bfloat16, quant=QuantConfig(experts="nf4"), wrap=_with_expert_lora)
    reference, _ = load_model(cfg, dtype=torch.bfloat16, wrap=_with_expert_lora)
    wrappers = [m.base_model.model.model.language_model.layers[1].mlp.experts for m in (model, reference)]
    with torch.no_grad():
        for name in EXPERT_WEIGHTS:
            getattr(experts_base(wrappers[1]), name).copy_(getattr(experts_base(wrappers[0]), name))
    torch.manual_seed(0)
    hidden, ids = torch.randn(2, 64, dtype=torch.bfloat16), torch.tensor([[3, 0], [7, 3]])
    weights = torch.rand(2, 2, dtype=torch.bfloat16)
    shapes = []
    dequantize = bnb_functional.dequantize_4bit
    monkeypatch.setattr(bnb_functional, "dequantize_4bit",
                        lambda A, state, *a, **kw: shapes.append(tuple(state.shape)) or dequantize(A, state, *a, **kw))
    outputs = []
    for m, wrapper in zip((model, reference), wrappers):
        y = wrapper.eval()(hidden, ids, weights)
        y.float().square().sum().backward()
        outputs.append((y.detach(), [p.grad for n, p in wrapper.named_parameters() if "lora" in n]))
    # the routed path, the 4 pairs' experts only: forward both stacks; backward down_proj's once more
    # (the gradient that reaches gate_up's adapter; the input needs none), nothing kept from forward
    assert shapes == [(4 * 64 * 64,), (4 * 64 * 32,), (4 * 64 * 32,)]
    torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=0, atol=0)
    assert len(outputs[0][1]) == 4 and all(g is not None for g in outputs[0][1])
    for got, want in zip(*(o[1] for o in outputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["grouped_mm", "batched_mm", "eager"])
def test_training_keeps_no_dequantized_expert_stack_for_backward(batch, kernel):
    """A training forward through NF4 experts (expert LoRA, and the layers below learning) saves no
    [E, out, in]-shaped tensor for backward: backward dequantizes the stacks again (moe_lora's
    _Redequantized). transformers' eager loop, kept as the reference, does keep them."""
    cfg = ModelConfig(preset="tiny-moe", experts_implementation=kernel)
    model, _ = load_model(cfg, dtype=torch.bfloat16, quant=QuantConfig(experts="nf4"), wrap=_with_expert_lora)
    saved = []

    def pack(t):  # a stack, or one expert's matrix viewing a whole stack's storage (the eager loop's w[e])
        if tuple(t.shape[-2:]) in {(64, 64), (64, 32), (32, 64)} and t.untyped_storage().nbytes() in {8 * 64 * 64 * 2,
                                                                                                     8 * 64 * 32 * 2}:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.eval()(**batch).logits.float().square().mean()
    loss.backward()
    kept = saved
    assert (kept == []) == (kernel != "eager"), kept
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n and "lora" in n)


def test_delta_factors_are_peft_s_and_read_no_nf4_weight(monkeypatch):
    from peft.tuners.lora.layer import ParamWrapper

    from vlforge.model.moe_lora import delta_factors

    plain, _ = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16, wrap=_with_expert_lora)
    wrappers = [m for m in plain.modules() if isinstance(m, ParamWrapper)]
    assert len(wrappers) == 4
    for w in wrappers:
        for got, want in zip(delta_factors(w, "default", torch.bfloat16), w.get_delta_factors("default")):
            assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    nf4, _ = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16, quant=QuantConfig(experts="nf4"),
                        wrap=_with_expert_lora)
    reads = []
    dequantize = bnb_functional.dequantize_4bit
    monkeypatch.setattr(bnb_functional, "dequantize_4bit", lambda *a, **kw: reads.append(1) or dequantize(*a, **kw))
    for w in (m for m in nf4.modules() if isinstance(m, ParamWrapper)):
        assert delta_factors(w, "default", torch.bfloat16)[0].dtype == torch.bfloat16
    assert not reads


def test_moe_qlora_trains_expert_adapters_on_nf4_experts_and_serves_them(shapes_dir, tmp_path):
    from safetensors.torch import load_file

    from vlforge.model.export import export
    from vlforge.recipes.sft import run_sft
    from vlforge.infer.model import InferenceModel

    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "model.preset=tiny-moe", "precision.mode=bf16",
                            "tiers.method=lora", "tiers.language.experts=true", "quant.language=nf4",
                            "train.max_steps=2", "data.val=null"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics if "loss" in m)
    adapters = load_file(ckpt / "adapter_model.safetensors")
    expert_b = [v for k, v in adapters.items() if "experts" in k and "lora_B" in k]
    assert len(expert_b) == 4 and all(v.abs().max() > 0 for v in expert_b)  # trained from B = 0
    engine = InferenceModel.load(str(ckpt), device="cpu")  # the run's own base: NF4 attention and experts
    assert engine.quant_report["linears"]["experts:nf4"] == 4 and engine.quant_report["linears"]["language:nf4"] == 8

    def requests():
        red = Image.new("RGB", (64, 48), (200, 30, 30))
        return [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What shape?"}]}],
                        [red], max_new_tokens=6, min_new_tokens=6),
                Request([{"role": "user", "content": "hi"}], max_new_tokens=4, min_new_tokens=4)]

    ours = [c.text for c in engine.generate(requests())]  # generate/'s engine on the NF4 experts + adapters
    from helpers import transformers_answers  # transformers' generate on the same model

    assert [text for text, _ in transformers_answers(engine, requests())] == ours and all(ours)
    with pytest.raises(ConfigError, match="MoE model.*export without --quant"):
        export(ckpt, tmp_path / "nf4", merge=True, quant=QuantConfig.from_flag("nf4"))
    assert not (tmp_path / "nf4").exists()
    assert export(ckpt, tmp_path / "merged", merge=True)["quant"] == "none"  # merged into the bf16 base


def test_a_peft_forward_expert_lora_checkpoint_is_served_fused_on_nf4_experts(shapes_dir, tmp_path):
    """An adapter trained with tiers.expert_lora=peft (bf16 experts), loaded with --quant nf4: its
    experts are NF4, so it is served through the fused forward (peft's would stack one more
    parametrization on them every call), and the same request gives the same answer twice."""
    from vlforge.model.moe_lora import FusedExpertsLoRA
    from vlforge.recipes.sft import run_sft
    from vlforge.infer.model import InferenceModel

    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "model.preset=tiny-moe", "precision.mode=bf16",
                            "tiers.method=lora", "tiers.language.experts=true", "tiers.expert_lora=peft",
                            "train.max_steps=1", "data.val=null"))
    engine = InferenceModel.load(str(tmp_path / "run" / "checkpoint-1"), quant=QuantConfig.from_flag("nf4"),
                                  device="cpu")
    assert engine.quant_report["linears"]["experts:nf4"] == 4
    layers = engine.model.base_model.model.model.language_model.layers
    assert all(type(layer.mlp.experts) is FusedExpertsLoRA for layer in layers)
    ask = [Request([{"role": "user", "content": "hi"}], max_new_tokens=6, min_new_tokens=6)]
    first = engine.generate(ask)[0].text
    assert engine.generate(ask)[0].text == first
    assert all(len(experts.parametrizations[name]) == 1
               for experts in _experts(engine.model) for name in EXPERT_WEIGHTS)


def test_nf4_expert_refusals(shapes_dir, tmp_path):
    from vlforge.train.trainable import setup_model

    with pytest.raises(ConfigError, match="tiers.expert_lora=peft cannot run on NF4 experts: .* stacks one more"):
        setup_model(tiny_sft_config(shapes_dir, tmp_path, "model.preset=tiny-moe", "tiers.method=lora",
                                    "tiers.language.experts=true", "tiers.expert_lora=peft", "quant.language=nf4"))
    with pytest.raises(ConfigError, match="dense model, it has no experts"):
        load_model(ModelConfig(preset="tiny"), quant=QuantConfig(experts="nf4"))
    assert QuantConfig.from_flag("nf4").expert_method == "nf4" and QuantConfig.from_flag("int8").expert_method == "none"


def test_plan_counts_nf4_experts_and_the_staged_load_on_30b_a3b(capsys):
    from vlforge.cli import main

    memory = {}
    for experts in ("auto", "none"):
        assert main(["sft", "configs/qwen3vl-30b-a3b-lora.yaml", "quant.language=nf4", f"quant.experts={experts}",
                     "--plan", "--json"]) == 0
        memory[experts] = json.loads(capsys.readouterr().out)["memory"]
    nf4, bf16 = memory["auto"], memory["none"]
    # 29.0B expert weights: 2 bytes each in bf16, 0.516 in NF4 (4 bits + the scales)
    saved = bf16["no_offload"]["parameters"]["gpu"] - nf4["no_offload"]["parameters"]["gpu"]
    assert 42e9 < saved < 44e9
    assert nf4["load"]["staged_experts"] and not bf16["load"].get("staged_experts")
    # the GPU gets the packed model plus one bf16 [128, 1536, 2048] stack; host memory holds it all first
    assert nf4["load"]["gpu"] - nf4["no_offload"]["parameters"]["gpu"] == pytest.approx(128 * 1536 * 2048 * 2, rel=0.01)
    assert nf4["load"]["host_rank0"] > bf16["no_offload"]["parameters"]["gpu"]


@pytest.mark.gpu
def test_staged_nf4_expert_load_on_cuda_matches_the_cpu_load_and_trains(batch, shapes_dir, tmp_path):
    """On a GPU the quantized MoE loads staged (host memory first, each expert stack quantized on
    the GPU): everything ends on the GPU, the NF4 values are the CPU load's of the same checkpoint, and
    QLoRA trains on it. (One saved checkpoint: a preset's random weights depend on the device it is
    initialised on, which for presets is the target device.)"""
    from vlforge.recipes.sft import run_sft

    q = QuantConfig.from_flag("nf4")
    ref, processor = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    cpu, _ = load_model(ModelConfig(path=str(tmp_path / "ckpt")), dtype=torch.bfloat16, quant=q)
    gpu, _ = load_model(ModelConfig(path=str(tmp_path / "ckpt")), dtype=torch.bfloat16, device="cuda", quant=q)
    assert verify(gpu, q)["linears"]["experts:nf4"] == 4
    assert {t.device.type for t in [*gpu.parameters(), *gpu.buffers()]} == {"cuda"}
    with torch.no_grad():
        for on_gpu, on_cpu in zip(_experts(gpu), _experts(cpu)):
            for name in EXPERT_WEIGHTS:
                assert getattr(on_gpu, name).device.type == "cuda"
                torch.testing.assert_close(getattr(on_gpu, name).cpu(), getattr(on_cpu, name), rtol=0, atol=1e-3)
        logits = gpu(**{k: v.cuda() for k, v in batch.items()}).logits.float().cpu()
        torch.testing.assert_close(logits, cpu(**batch).logits.float(), rtol=0.05, atol=0.05)
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "model.preset=tiny-moe", "precision.mode=bf16",
                            "train.device=cuda", "tiers.method=lora", "tiers.language.experts=true",
                            "quant.language=nf4", "train.max_steps=2", "data.val=null"))
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").is_file()


def test_grpo_on_nf4_experts_trains_expert_adapters_with_router_replay(shapes_dir, tmp_path):
    """QLoRA GRPO on an MoE: rollouts decode on the NF4 experts (the generation engine reads them
    through the parametrization), the trainer replays the rollout's experts, KL to the disabled
    adapters, and every expert adapter moves."""
    from safetensors.torch import load_file

    from test_grpo import grpo_config
    from vlforge.recipes.grpo import run_grpo

    run_grpo(grpo_config(shapes_dir, tmp_path / "run", tmp_path, "model.preset=tiny-moe", "tiers.method=lora",
                         "tiers.language.experts=true", "quant.language=nf4", "precision.mode=bf16",
                         "rl.kl_beta=0.1", "rollout.router_replay=true", "train.seed=1", "train.max_steps=2"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "loss" in r]
    assert trained and all(r["groups_trained"] > 0 for r in trained)
    # rollout and trainer compute on the same NF4 weights: the log-probs agree and few routes differ
    # (bf16 arithmetic, then the update)
    assert trained[0]["approx_kl"] < 1e-2 and all(r["moe/route_flip"] < 0.1 for r in trained)
    adapters = load_file(tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors")
    expert_b = [v for k, v in adapters.items() if "experts" in k and "lora_B" in k]
    assert len(expert_b) == 4 and all(v.abs().max() > 0 for v in expert_b)


def test_expert_stacks_reach_bitsandbytes_contiguous(monkeypatch):
    """bitsandbytes' CUDA kernels read a tensor's bytes in storage order whatever its strides (its CPU
    code does not, so the CPU tests cannot see it), and a checkpoint's expert stacks can load as
    transposed views: quantize_experts hands it contiguous stacks."""
    from vlforge.model.quant import quantize_experts

    model, _ = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16)
    for experts in _experts(model):  # as a checkpoint in [E, in, out] loads: transposed views
        for name in EXPERT_WEIGHTS:
            weight = experts._parameters[name]
            experts._parameters[name] = torch.nn.Parameter(
                weight.data.transpose(1, 2).contiguous().transpose(1, 2), requires_grad=False)
            assert not experts._parameters[name].is_contiguous()
    seen, real = [], bnb_functional.quantize_4bit
    monkeypatch.setattr(bnb_functional, "quantize_4bit", lambda A, *a, **k: (seen.append(A.is_contiguous()),
                                                                              real(A, *a, **k))[1])
    assert quantize_experts(model, torch.device("cpu")) == 4
    assert seen == [True] * 4


def test_the_staged_load_maps_the_checkpoint_instead_of_copying_it(tmp_path):
    """What README's staged-load memory claim rests on: transformers, loading a checkpoint in its
    stored dtype to the CPU (device_map="cpu", with the bitsandbytes config, as model/load.py's staged
    load does), leaves the expert weights as views of the memory-mapped safetensors file."""
    from vlforge.model.load import build_meta_model, model_class
    from vlforge.model.quant import from_pretrained_kwargs, quant_plan

    model, processor = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    q = QuantConfig.from_flag("nf4")
    meta, _ = build_meta_model(ModelConfig(path=str(tmp_path)))
    loaded = model_class(meta.config).from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu",
                                                      **from_pretrained_kwargs(q, quant_plan(meta, q)))
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        maps.append((start, end, rest[-1] if len(rest) >= 5 else ""))
    for experts in _experts(loaded):
        pointer = experts.gate_up_proj.untyped_storage().data_ptr()
        assert [name for start, end, name in maps if start <= pointer < end] == [str(tmp_path / "model.safetensors")]


@pytest.mark.gpu
def test_nf4_expert_decode_under_cuda_graphs_equals_eager(shapes_dir):
    """NF4-expert models decode under CUDA graphs (generate/plan.py `graphs_possible` lets them since this
    passed on an H100, 2026-12-05): the captured decode steps (grouped_mm, the routed path at 1-2
    rows) give the eager steps' tokens."""
    from vlforge.data.encode import encode_prompt
    from vlforge.generate.engine import Engine
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, Prompt

    model, processor = load_model(ModelConfig(preset="tiny-moe"), dtype=torch.bfloat16, device="cuda",
                                  quant=QuantConfig.from_flag("nf4"))
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    prompts = [encode_prompt(data.encoder, s) for s in data.samples[:3]]
    requests = [GenRequest(Prompt(p["input_ids"], p.get("pixel_values"), p.get("image_grid_thw")), n=n,
                           max_new_tokens=8, temperature=t, seed=1, first_row=2 * i)
                for i, (p, n, t) in enumerate(zip(prompts, (1, 2, 1), (0.0, 1.0, 0.0)))]
    kwargs = dict(stop_ids=[], banned_ids=vision_token_ids(data.encoder), image_token_id=data.encoder.image_token_id,
                  pad_id=data.encoder.pad_id)
    graphs = Engine(model.eval(), use_graphs=True)
    captured = graphs.generate(requests, **kwargs)
    assert graphs.runner.graphs
    eager = Engine(model, use_graphs=False).generate(requests, **kwargs)
    for a, b in zip(captured, eager):
        assert torch.equal(a.tokens, b.tokens)
