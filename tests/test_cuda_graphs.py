"""compile.cuda_graphs (and cuda_graphs_vision): SFT's compiled blocks replayed as CUDA graphs on packed rows.

On CUDA (gpu-marked) the recipe trains to the weights the plainly compiled layers give, with one
micro-batch a step and with two (gradient accumulation: autograd keeps a backward replay's output as
`.grad` when a parameter has none, and the next replay would overwrite it: pytorch#169545), and
evaluates between steps (eager). On the CPU: where it is refused, and the rows it asks for.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from vlforge.config import ConfigError, GRPOConfig, load_config
from vlforge.train.trainable import CUDA_GRAPH_ROW_MULTIPLE, VISION_SHAPES_WARN, Trainable, cuda_graph_step_begin
from vlforge.recipes.grpo import run_grpo
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

ON = ["compile.cuda_graphs=true", "compile.enabled=true"]


def test_refused_where_it_is_not_built_before_the_model_loads(shapes_dir, tmp_path):
    with pytest.raises(ConfigError, match="set compile.enabled=true"):  # auto may compile nothing
        tiny_sft_config(shapes_dir, tmp_path, "compile.cuda_graphs=true")
    with pytest.raises(ConfigError, match="set compile.cuda_graphs=true too"):
        tiny_sft_config(shapes_dir, tmp_path, "compile.enabled=true", "compile.cuda_graphs_vision=true")
    with pytest.raises(ConfigError, match="activation_checkpointing.enabled"):
        tiny_sft_config(shapes_dir, tmp_path, *ON, "activation_checkpointing.enabled=true")
    with pytest.raises(ConfigError, match="packed rows .* data.packing=true"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path / "a", *ON, "data.packing=false"))
    with pytest.raises(ConfigError, match="compile.cuda_graphs runs on one CUDA GPU .* not with device cpu"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path / "b", *ON, "data.packing=true"))
    grpo = load_config(GRPOConfig, None, ["model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}",
                                          "train.device=cpu", f"train.output_dir={tmp_path / 'c'}", *ON])
    with pytest.raises(ConfigError, match="SFT's packed rows, not GRPO"):
        run_grpo(grpo)
    assert not any((tmp_path / d).exists() for d in "abc")  # refused before a run began


def test_rows_come_in_steps_of_the_graph_multiple():
    plain = Trainable(None, None, [], None, torch.device("cpu"))
    graphs = Trainable(None, None, [], None, torch.device("cpu"), cuda_graphs=True)
    assert plain.token_multiple == 1 and graphs.token_multiple == CUDA_GRAPH_ROW_MULTIPLE == 256


def test_the_vision_graphs_warn_once_when_image_sizes_vary(monkeypatch):
    """Every new image layout (patches per image in a micro-batch) records the tower's graphs again:
    after VISION_SHAPES_WARN of them the run says so, once; the decoder layers' graphs alone (rows
    padded to few lengths) never warn."""
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)  # no CUDA here
    images = lambda *sides: {"pixel_values": torch.zeros(sum(s * s for s in sides), 4),
                             "image_grid_thw": torch.tensor([[1, s, s] for s in sides])}
    both = Trainable(torch.nn.Linear(2, 2), None, [], None, torch.device("cpu"), cuda_graphs=True,
                     cuda_graphs_vision=True)
    said = [cuda_graph_step_begin(both, [images(*sides)], 0) for sides in [(4,), (4, 4), (8,)] * 5]
    assert not any(said)
    said = [cuda_graph_step_begin(both, [images(2, side)], 0) for side in range(2, 12)]  # 3 layouts, then new
    assert sum(map(bool, said)) == 1 and said.index(next(filter(None, said))) == VISION_SHAPES_WARN - 3 - 1
    assert "compile.cuda_graphs_vision off" in next(filter(None, said))
    assert cuda_graph_step_begin(both, [{"pixel_values": None}], 0) is None  # a text-only micro-batch
    layers_only = Trainable(torch.nn.Linear(2, 2), None, [], None, torch.device("cpu"), cuda_graphs=True)
    assert not any(cuda_graph_step_begin(layers_only, [images(side)], 0) for side in range(2, 20))


@pytest.mark.parametrize("vision_graphs", [False, True])
def test_several_micro_batches_give_the_graphed_blocks_gradient_buffers_first(tiny, monkeypatch, vision_graphs):
    """Only the parameters whose gradients graphs produce, and only those the step reaches: the vision
    blocks when graphed and a micro-batch has images; everything else keeps autograd's own buffers."""
    import copy

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    model = copy.deepcopy(tiny[0])
    t = Trainable(model, None, [], None, torch.device("cpu"), cuda_graphs=True, cuda_graphs_vision=vision_graphs)
    text, image = {"input_ids": torch.zeros(1, 4)}, {"pixel_values": torch.zeros(4, 4),
                                                     "image_grid_thw": torch.tensor([[1, 2, 2]])}
    layer = model.model.language_model.layers[0].self_attn.q_proj.weight
    block = model.model.visual.blocks[0].attn.qkv.weight
    cuda_graph_step_begin(t, [image], 0)
    assert layer.grad is None and block.grad is None  # one micro-batch: read before the next replay
    cuda_graph_step_begin(t, [text, text], 0)
    assert torch.equal(layer.grad, torch.zeros_like(layer)) and block.grad is None  # the tower is not reached
    assert model.model.language_model.embed_tokens.weight.grad is None  # not graphed
    layer.grad = None
    cuda_graph_step_begin(t, [text, image], 0)
    assert layer.grad is not None and (block.grad is not None) == vision_graphs
    assert model.model.visual.merger.linear_fc1.weight.grad is None  # the merger is outside the blocks


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return {k: v.float() for f in sorted(checkpoint.glob("model*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.gpu
@pytest.mark.parametrize("grad_accum, graphed", [(1, "layers"), (2, "layers"), (2, "layers+vision")])
def test_cuda_graphs_train_to_the_compiled_layers_weights(shapes_dir, tmp_path, grad_accum, graphed, monkeypatch):
    common = ["train.device=cuda", "precision.mode=bf16", "compile.enabled=true", "data.packing=true",
              "tiers.method=full", f"train.grad_accum={grad_accum}", "train.max_steps=4", "train.save_every=1",
              "train.keep_last=4", "eval.every=2", "optim.schedule=constant", "tiers.language.lr=1e-3",
              "tiers.projector.lr=1e-3", "tiers.vision.lr=1e-3",
              "tiers.language.dropout=0", "tiers.projector.dropout=0", "tiers.vision.dropout=0"]
    # the compiled run's rows padded as the graphs run pads them: the same shapes, the same kernels
    monkeypatch.setattr(Trainable, "token_multiple", property(lambda self: CUDA_GRAPH_ROW_MULTIPLE))
    plain, graphs = tmp_path / "compiled", tmp_path / "graphs"
    run_sft(tiny_sft_config(shapes_dir, plain, *common))
    vision = ["compile.cuda_graphs_vision=true"] if graphed == "layers+vision" else []
    result = run_sft(tiny_sft_config(shapes_dir, graphs, *common, "compile.cuda_graphs=true", *vision))
    assert result["final_step"] == 4 and (graphs / "eval.json").is_file()  # evaluated (eager) between steps
    assert _losses(graphs) == pytest.approx(_losses(plain), rel=1e-2)
    # the two runs' final weights, against how far the compiled run moved them over its last 3 steps (a
    # wrong accumulation moves them elsewhere by about that much; kernels' rounding, far less)
    after_one, compiled, replayed = (_weights(d / "checkpoint-N".replace("N", n)) for d, n in
                                     ((plain, "1"), (plain, "4"), (graphs, "4")))
    for name, w in compiled.items():
        moved = (w - after_one[name]).abs().mean().item()
        if moved > 0:
            apart = (replayed[name] - w).abs().mean().item()
            assert apart < 0.1 * moved, (name, apart, moved)
