"""generate/fused.py: a decoder layer's q/k/v and gate/up projections as one GEMM each, in the engine's
prefill and decode steps, against transformers' one GEMM per projection."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlforge.config import DataConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import encode_prompt
from vlforge.generate.engine import Engine
from vlforge.generate.forward import vision_token_ids
from vlforge.generate.fused import FusedProjections
from vlforge.generate.requests import GenRequest, Prompt

from helpers import compiled_on_cpu


@pytest.fixture
def setup(tiny, shapes_dir):
    model, processor = tiny
    model = copy.deepcopy(model).eval().requires_grad_(False)  # an inference model: its weights are fused
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    return model, data.encoder, data.samples


def requests_of(encoder, samples, n=1, temperature=0.0):
    out = []
    for i, s in enumerate(samples):
        x = encode_prompt(encoder, s)
        out.append(GenRequest(Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw")), n=n,
                              max_new_tokens=6 + 3 * i, temperature=temperature, seed=5, first_row=n * i))
    return out


def run(engine, encoder, requests):
    return engine.generate(requests, stop_ids=[], banned_ids=vision_token_ids(encoder),
                           image_token_id=encoder.image_token_id, pad_id=encoder.pad_id)


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def language_model_logits(core, ids):
    return core.lm_head(core.model.language_model(input_ids=ids).last_hidden_state)


def test_fused_groups_compute_transformers_projections_in_one_gemm_each(setup):
    """Inside `installed()` a language-model forward runs 4 GEMMs a layer instead of 7 (q/k/v one,
    gate/up one) and gives transformers' logits; the weights are views of one buffer per group with
    their values and Parameter objects kept; outside, the modules' own forwards run again."""
    model, _, _ = setup
    layers = model.model.language_model.layers
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in params.items()}
    ids = torch.randint(0, model.config.text_config.vocab_size, (3, 7))
    with torch.no_grad(), CountMatmuls() as plain:
        reference = language_model_logits(model, ids)
    fused = FusedProjections(model)
    assert fused.prepare() == 2 * len(layers)
    attn = layers[0].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
    for n, p in model.named_parameters():
        assert p is params[n] and torch.equal(p, before[n]), n
    with torch.no_grad(), fused.installed(), CountMatmuls() as grouped:
        out = language_model_logits(model, ids)
    assert plain.count - grouped.count == 3 * len(layers)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert "forward" not in attn.q_proj.__dict__  # uninstalled
    buffer = fused.groups[0].buffer
    assert fused.prepare() == 2 * len(layers) and fused.groups[0].buffer is buffer  # no second copy
    # a second engine's groups find the same buffer from the weights' storage: nothing copied again
    again = FusedProjections(model)
    assert again.prepare() == 2 * len(layers) and again.groups[0].buffer.data_ptr() == buffer.data_ptr()
    assert attn.q_proj.weight.data_ptr() == q.data_ptr()


def test_trained_models_keep_their_weights_storage_but_for_marked_and_lora_base_weights(tiny):
    """A model with a parameter that trains: its frozen plain weights keep their storage (the run
    saves the model whole), weights marked FUSABLE (rollout copies) are fused; an inference model's
    are; a merged LoRA adapter keeps its group unfused (peft unmerges it inside the forward)."""
    from peft import LoraConfig, get_peft_model

    from vlforge.generate.fused import FUSABLE

    model = copy.deepcopy(tiny[0])
    layers = model.model.language_model.layers
    assert FusedProjections(model).prepare() == 0  # trainable
    model.requires_grad_(False)
    layers[0].mlp.up_proj.weight.requires_grad_(True)  # one trains: the frozen plain weights stay as they are
    assert FusedProjections(model).prepare() == 0
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(getattr(layers[1].self_attn, name).weight, FUSABLE, True)
    assert FusedProjections(model).prepare() == 1
    model.requires_grad_(False)
    assert FusedProjections(model).prepare() == 2 * len(layers)  # an inference model

    lora = get_peft_model(copy.deepcopy(tiny[0]), LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj"]))
    assert FusedProjections(lora.base_model.model).prepare() == len(layers)  # the frozen bases, beside trained adapters
    lora.merge_adapter()
    assert FusedProjections(lora.base_model.model).prepare() == 0


def test_weights_are_adopted_outside_inference_mode(setup):
    """A first generate under torch.inference_mode must not make the weights views of an inference
    tensor: a LoRA base could then never be saved for backward, nor a rollout copy refreshed."""
    model, _, _ = setup
    with torch.inference_mode():
        FusedProjections(model).prepare()
    q = model.model.language_model.layers[0].self_attn.q_proj.weight
    assert not q.is_inference()
    q.data.mul_(1.0)  # in place, outside inference mode


def test_a_model_with_fused_weights_saves_and_loads_as_before(setup, tmp_path):
    from transformers import AutoModelForImageTextToText

    model, _, _ = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    FusedProjections(model).prepare()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, local_files_only=True)
    for n, p in loaded.named_parameters():
        assert torch.equal(p, before[n]), n


def test_the_engine_with_fused_projections_gives_the_tokens_of_one_gemm_per_projection(setup):
    """Greedy and sampled (GroupCache and SlotCache), fp32 on the CPU: the same tokens, log-probs
    within fp32 rounding."""
    model, encoder, samples = setup
    for n, temperature in ((1, 0.0), (2, 1.0), (1, 1.0)):
        requests = requests_of(encoder, samples[:3], n=n, temperature=temperature)
        fused_engine = Engine(model)
        fused = run(fused_engine, encoder, requests)
        assert fused_engine.plan.fusing
        plain = run(Engine(model, fuse_projections=False), encoder, requests)
        for a, b in zip(fused, plain):
            assert torch.equal(a.tokens, b.tokens), (n, temperature)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)


class GemmOperands(TorchDispatchMode):
    """Every GEMM's second operand (the weight, transposed: F.linear is t + mm at dispatch), as
    (storage address, shape)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            weight = args[-1]
            self.seen.append((weight.untyped_storage().data_ptr(), tuple(weight.shape)))
        return func(*args, **(kwargs or {}))


def gemms_per_call(engine) -> dict[str, list[list]]:
    """The GEMM operands of each prefill and each decode step the engine runs (its runner's methods,
    wrapped on the instance: the engine and the runner call them through it)."""
    calls: dict[str, list[list]] = {"prefill": [], "step": []}
    for name in calls:
        original = getattr(engine.runner, name)

        def counted(*args, original=original, name=name):
            with GemmOperands() as mode:
                out = original(*args)
            calls[name].append(mode.seen)
            return out
        setattr(engine.runner, name, counted)
    return calls


def test_the_engines_prefill_and_decode_steps_run_one_gemm_per_group(setup):
    """The engine's own forwards (prefill and every decode step), not FusedProjections alone: each
    layer's q/k/v and gate/up are computed by one GEMM over the whole fused buffer (2 a layer, none
    reading a member's rows alone), and a decode step runs 3 GEMMs a layer fewer than the unfused
    engine's, giving its tokens."""
    model, encoder, samples = setup
    layers = len(model.model.language_model.layers)
    requests = requests_of(encoder, samples[:3], n=2, temperature=1.0)
    fused_engine, plain_engine = Engine(model), Engine(model, fuse_projections=False)
    fused_calls, plain_calls = gemms_per_call(fused_engine), gemms_per_call(plain_engine)
    fused, plain = run(fused_engine, encoder, requests), run(plain_engine, encoder, requests)
    for a, b in zip(fused, plain):
        assert torch.equal(a.tokens, b.tokens)
    buffers = {g.buffer.untyped_storage().data_ptr(): tuple(g.buffer.t().shape) for g in fused_engine.runner.fused.groups}
    assert len(buffers) == 2 * layers
    assert len(fused_calls["step"]) == len(plain_calls["step"]) > 3 and fused_calls["prefill"]
    for kind in ("prefill", "step"):
        for seen in fused_calls[kind]:
            on_buffers = [shape for ptr, shape in seen if ptr in buffers]
            # every GEMM reading fused weights reads a whole group: one per group and forward
            assert sorted(on_buffers) == sorted(buffers.values()), kind
    for fused_step, plain_step in zip(fused_calls["step"], plain_calls["step"]):
        assert len(plain_step) - len(fused_step) == 3 * layers


def test_the_compiled_decode_step_traces_the_fused_projections_as_one_graph(setup, monkeypatch):
    """dynamo follows the fused forwards (their shared state is Python attributes): the compiled
    step compiles once as one graph and gives the eager engine's tokens."""
    from torch._dynamo.utils import counters

    model, encoder, samples = setup
    engine = compiled_on_cpu(Engine(model, compile=True), monkeypatch)
    requests = requests_of(encoder, samples[:3], n=2, temperature=1.0)
    graphs = counters["stats"]["unique_graphs"]
    compiled = run(engine, encoder, requests)
    run(engine, encoder, requests)
    assert engine.plan.fusing and engine.compile_failure is None
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the layers once, _pick once
    eager = run(Engine(model, fuse_projections=False), encoder, requests)
    for a, b in zip(compiled, eager):
        assert torch.equal(a.tokens, b.tokens)


def test_rollout_copies_of_fp32_masters_are_fused_and_follow_the_masters(tiny, shapes_dir):
    """GRPO with fp32 masters generates on bf16 copies of the linears (inference_weights): the engine
    fuses the copies, and after the masters change the next rollout reads the new values (the
    copies are refreshed into the fused buffers), the tokens of an unfused engine each time."""
    from vlforge.config import PrecisionConfig
    from vlforge.train.precision import PrecisionPolicy

    model = copy.deepcopy(tiny[0]).eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny[1], DataConfig())
    policy = PrecisionPolicy(PrecisionConfig(mode="bf16"), "cpu")
    policy.apply(model)
    requests = requests_of(data.encoder, data.samples[:2], n=2, temperature=1.0)
    fused_engine, plain_engine = Engine(model), Engine(model, fuse_projections=False)
    q_master = model.model.language_model.layers[0].self_attn.q_proj.weight
    rounds = []
    for round_ in range(2):
        with policy.autocast(), policy.inference_weights(model):
            fused = run(fused_engine, data.encoder, requests)
            assert fused_engine.plan.fusing
            plain = run(plain_engine, data.encoder, requests)
        for a, b in zip(fused, plain):
            assert torch.equal(a.tokens, b.tokens), round_
        rounds.append([r.tokens for r in fused])
        assert model.model.language_model.layers[0].self_attn.q_proj.weight is q_master  # given back
        with torch.no_grad():  # an optimizer step on the masters
            for p in model.model.language_model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    assert any(not torch.equal(a, b) for a, b in zip(*rounds))  # the second rollout read the new weights


@pytest.mark.gpu
def test_cuda_graphs_of_the_compiled_fused_step_give_the_unfused_eager_tokens(setup):
    model, encoder, samples = setup
    model = model.cuda()
    for n in (1, 3):
        requests = requests_of(encoder, samples[:4], n=n, temperature=1.0)
        graphs = Engine(model, use_graphs=True, compile=True)
        fused = run(graphs, encoder, requests)
        assert graphs.plan.fusing and graphs.runner.graphs and graphs.compile_failure is None
        eager = run(Engine(model, use_graphs=False, fuse_projections=False), encoder, requests)
        for a, b in zip(fused, eager):
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)


def test_lora_layers_fuse_their_frozen_base_layers_and_keep_their_adapters(setup):
    """peft LoRA on q/k/v and gate/up (adapters not zero): the base layers' GEMMs are fused, the
    adapters still add their product: the tokens and log-probs of the unfused engine."""
    from peft import LoraConfig, get_peft_model

    model, encoder, samples = setup
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])).eval()
    core = lora.base_model.model
    layers = len(core.model.language_model.layers)
    requests = requests_of(encoder, samples[:3], n=2, temperature=1.0)
    fused_engine = Engine(lora)
    fused = run(fused_engine, encoder, requests)
    assert fused_engine.plan.fusing and len(fused_engine.runner.fused._active) == 2 * layers
    assert fused_engine.runner.fused.groups[0].linears[0] is core.model.language_model.layers[0].self_attn.q_proj.base_layer
    plain = run(Engine(lora, fuse_projections=False), encoder, requests)
    without_adapters = run(Engine(model, fuse_projections=False), encoder, requests)
    for a, b in zip(fused, plain):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
    assert any(not torch.equal(a.tokens, c.tokens) for a, c in zip(fused, without_adapters))  # the adapters count


def test_nothing_is_fused_under_fsdp2(setup, tmp_path):
    """FSDP2 for real (fully_shard on a one-rank gloo group): while its units are gathered (GRPO's
    rollouts: train/sharding.fully_gathered) the weights are views of its all-gather buffers,
    which a `.data` swap would cut off from the next gather: the engine leaves them there, and
    generates the unsharded model's tokens, also after a reshard and a new gather."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, encoder, samples = setup
    requests = requests_of(encoder, samples[:2], n=2, temperature=1.0)
    expected = run(Engine(model, fuse_projections=False), encoder, requests)
    sharded = copy.deepcopy(model)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))  # the CPU, also where a GPU is visible (fully_shard's default)
        units = [fully_shard(layer, mesh=mesh) for layer in sharded.model.language_model.layers] + \
            [fully_shard(sharded, mesh=mesh)]
        attn = sharded.model.language_model.layers[0].self_attn
        for gather in range(2):
            for unit in reversed(units):  # as fully_gathered: gathered until the rollout ends
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
            gathered = [m.weight.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
            assert type(attn.q_proj.weight.data) is torch.Tensor  # gathered: plain tensors, fusable but for FSDP
            assert FusedProjections(sharded).prepare() == 0
            engine = Engine(sharded)
            results = run(engine, encoder, requests)
            assert not engine.plan.fusing and "forward" not in attn.q_proj.__dict__
            assert [m.weight.data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)] == gathered, gather
            for a, b in zip(results, expected):
                assert torch.equal(a.tokens, b.tokens), gather
            for unit in units:
                unit.reshard()
    finally:
        dist.destroy_process_group()


def test_fused_greedy_equals_transformers_generate(setup):
    """The fused engine on an inference model, greedy, against transformers' own generate (left
    padding differing per row): the same tokens."""
    from vlforge.data.encode import collate

    model, encoder, samples = setup
    chosen = samples[:4]
    batch = collate([encode_prompt(encoder, s) for s in chosen], encoder.pad_id, left_pad=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=encoder.pad_id,
                             eos_token_id=None)
    reference = out[:, batch["input_ids"].shape[1]:]
    requests = [GenRequest(r.prompt, max_new_tokens=12) for r in requests_of(encoder, chosen)]
    engine = Engine(model)
    results = engine.generate(requests, stop_ids=[], banned_ids=[], image_token_id=encoder.image_token_id,
                              pad_id=encoder.pad_id)
    assert engine.plan.fusing
    assert torch.equal(torch.stack([r.tokens for r in results]), reference)
