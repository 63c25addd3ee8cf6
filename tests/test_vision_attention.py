"""model/varlen.py: the vision tower's attention over every image of a forward in one call, against
transformers' own per-image sdpa loop."""

import copy
import json

import pytest
import torch

import vlforge.model.varlen as varlen
from vlforge.config import AttentionConfig, ModelConfig
from vlforge.model.load import load_model


def pixels_of(config, grid: torch.Tensor) -> torch.Tensor:
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    return torch.randn(int(grid.prod(-1).sum()), width)


GRID = torch.tensor([[1, 4, 4], [1, 8, 4], [1, 4, 6]])  # three images of three sizes: 16, 32 and 24 patches


def tower_outputs(model, pixels, grid):
    out = model.model.visual(pixels, grid_thw=grid, return_dict=True)
    return [out.pooler_output, *out.deepstack_features]


def test_the_vision_tower_attends_per_image_in_one_call_as_transformers_sdpa_does(monkeypatch):
    """Loaded models use VISION_ATTENTION (the language model keeps sdpa); transformers' vision
    attention hands it the images' bounds (its varlen branch, one call a block) and the tower's
    outputs and gradients equal transformers' sdpa loop over the images (fp32, CPU: exact per-image
    SDPA); model.attention.vision=sdpa keeps transformers' own; nothing of it is saved."""
    model, _ = load_model(ModelConfig(preset="tiny"))
    visual = model.model.visual
    assert visual.config._attn_implementation == varlen.VISION_ATTENTION
    assert model.config.text_config._attn_implementation == "sdpa"
    reference, _ = load_model(ModelConfig(preset="tiny", attention=AttentionConfig(vision="sdpa")))
    assert reference.model.visual.config._attn_implementation == "sdpa"
    calls = []
    per_image = varlen._vision_per_image
    monkeypatch.setattr(varlen, "_vision_per_image", lambda q, k, v, bounds, cu, *a: calls.append(cu.tolist()) or
                        per_image(q, k, v, bounds, cu, *a))
    torch.manual_seed(0)
    pixels = pixels_of(visual.config, GRID)
    ours = tower_outputs(model, pixels.clone().requires_grad_(), GRID)
    theirs = tower_outputs(reference, pixels.clone().requires_grad_(), GRID)
    assert calls == [[0, 16, 48, 72]] * len(visual.blocks)  # every image of the forward, once a block
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    sum(o.square().sum() for o in ours).backward()
    sum(o.square().sum() for o in theirs).backward()
    grads = {n: p.grad for n, p in reference.model.visual.named_parameters()}
    for name, p in visual.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-5, msg=name)
    # the bounds matter: the three images attended as one differ from the three apart
    qkv = (torch.randn(1, 2, 72, 8),) * 3
    joined = varlen._vision_attention(None, *qkv, None, cu_seq_lens_q=torch.tensor([0, 72]), max_length_q=72)[0]
    split = varlen._vision_attention(None, *qkv, None, cu_seq_lens_q=torch.tensor([0, 16, 48, 72]), max_length_q=32)[0]
    assert joined.shape == split.shape == (1, 72, 2, 8) and not torch.allclose(joined, split, atol=1e-3)


def test_only_sdpa_switches_and_the_switch_is_not_saved(tmp_path):
    eager, _ = load_model(ModelConfig(preset="tiny", attention=AttentionConfig(implementation="eager")))
    assert not varlen.use_vision_varlen(eager)
    assert eager.model.visual.config._attn_implementation == "eager"
    model, _ = load_model(ModelConfig(preset="tiny"))
    model.save_pretrained(tmp_path)
    assert varlen.VISION_ATTENTION not in (tmp_path / "config.json").read_text()
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]
    with pytest.raises(ValueError, match="one row of images"):
        varlen._vision_attention(None, *(torch.randn(2, 2, 8, 8),) * 3, None, cu_seq_lens_q=torch.tensor([0, 8]))


def test_compiled_vision_blocks_do_not_compile_again_for_each_number_of_images():
    """The tower's host inputs (model/host_inputs.VisionGrid, as the recipe's loader makes them) carry
    the images' bounds; as a plain tuple dynamo guarded on its length, and a batch with a new number
    of images compiled every vision block again until torch's recompile limit (8) left them eager (the
    mixed-image set on the H200). Compiled blocks see 2..9 images a forward: after the second count
    (when the lengths turn dynamic) nothing compiles again, and the outputs are eager's."""
    from torch._dynamo.testing import CompileCounter

    from vlforge.model.host_inputs import VisionGrid

    model, _ = load_model(ModelConfig(preset="tiny"))
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counter = CompileCounter()
    for block in model.model.visual.blocks:
        block.compile(backend=counter)
    vision_grid = VisionGrid.of(model.model.visual)
    frames = []
    for images in (2, 3, 4, 5, 7, 9):
        grid = torch.tensor([[1, 4, 4 + 2 * (i % 2)] for i in range(images)])
        pixels = pixels_of(model.model.visual.config, grid)
        kwargs = vision_grid.kwargs_on(grid, torch.device("cpu"))
        ours = tower_outputs_with(model, pixels, grid, kwargs)
        for a, b in zip(ours, tower_outputs_with(eager, pixels, grid, kwargs)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[1] > frames[0] > 0  # the second count: the dynamic graphs
    assert frames[2:] == [frames[1]] * 4, frames  # then no new compile for 4, 5, 7 or 9 images
    torch._dynamo.reset()


def test_a_compiled_block_keeps_a_graph_for_every_variant_a_training_step_makes(monkeypatch):
    """One vision block's code, compiled as the recipe compiles it (train/trainable.compile_decoder_layers),
    called as a training step calls its blocks: weights in fp32 (trainable) or bf16 (frozen), an input
    that requires grad or not, a view (the tower's reshape; a graph made for a view guards on its base)
    or not, lengths and image counts that change (static, then dynamic): 9 graphs of one code object,
    the H200's mixed-image step's pattern. With torch's default limit (8) dynamo would run the last
    eager; fail_on_recompile_limit_hit turns that into an error here."""
    from vlforge.train.trainable import compile_decoder_layers

    model, _ = load_model(ModelConfig(preset="tiny"))
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager"))
    torch._dynamo.reset()
    config = model.model.visual.config
    blocks = {torch.float32: model.model.visual.blocks[0], torch.bfloat16: model.model.visual.blocks[1].bfloat16()}
    head = config.hidden_size // config.num_heads
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):  # restored on exit
        compile_decoder_layers(model, vision=True)
        for dtype, block in blocks.items():
            for grad in (False, True):
                for view in (True, False):
                    for n, images in ((16, 1), (24, 2), (40, 1)):
                        x = torch.randn(2 * n if view else n, config.hidden_size, dtype=dtype)
                        x = (x[:n] if view else x).requires_grad_(grad)
                        rope = (torch.ones(n, head), torch.zeros(n, head))
                        cu_seqlens = torch.tensor([0, 8, n] if images == 2 else [0, n], dtype=torch.int32)
                        out = block(x, cu_seqlens=cu_seqlens, position_embeddings=rope)
                        assert out.shape == (n, config.hidden_size)
    torch._dynamo.reset()


def tower_outputs_with(model, pixels, grid, kwargs):
    out = model.model.visual(pixels, grid_thw=grid, return_dict=True, **kwargs)
    return [out.pooler_output, *out.deepstack_features]


@pytest.mark.gpu
def test_the_vision_tower_runs_torch_varlen_attn_on_cuda_and_compiles_without_a_graph_break(monkeypatch):
    """On CUDA in bf16 the tower's attention is one varlen_attn call a block, its outputs and
    gradients within bf16 rounding of transformers' per-image sdpa loop; a compiled vision block
    traces it with no graph break (fullgraph)."""
    model, _ = load_model(ModelConfig(preset="tiny"), dtype=torch.bfloat16, device="cuda")
    reference = copy.deepcopy(model)
    reference.model.visual.config._attn_implementation = "sdpa"
    calls = []
    kernel = varlen._vision_varlen
    monkeypatch.setattr(varlen, "_vision_varlen", lambda *a: calls.append(1) or kernel(*a))
    torch.manual_seed(0)
    pixels = pixels_of(model.model.visual.config, GRID).to("cuda", torch.bfloat16)
    ours = tower_outputs(model, pixels.clone().requires_grad_(), GRID.cuda())
    theirs = tower_outputs(reference, pixels.clone().requires_grad_(), GRID.cuda())
    assert len(calls) == len(model.model.visual.blocks)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    sum(o.float().square().sum() for o in ours).backward()
    sum(o.float().square().sum() for o in theirs).backward()
    grads = {n: p.grad for n, p in reference.model.visual.named_parameters()}
    for name, p in model.model.visual.named_parameters():
        torch.testing.assert_close(p.grad.float(), grads[name].float(), atol=5e-2, rtol=5e-2, msg=name)
    torch._dynamo.reset()
    for block in model.model.visual.blocks:
        block.compile(fullgraph=True)
    compiled = tower_outputs(model, pixels, GRID.cuda())
    for a, b in zip(compiled, theirs):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
