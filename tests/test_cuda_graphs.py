"""precision.cuda_graphs (and cuda_graphs_vision): SFT's compiled blocks replayed as CUDA graphs on packed rows.

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
from vlforge.engine.trainable import CUDA_GRAPH_ROW_MULTIPLE, VISION_SHAPES_WARN, Trainable, cuda_graph_step_begin
from vlforge.recipes.grpo import run_grpo
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

ON = ["precision.cuda_graphs=true", "precision.compile=true"]


def test_refused_where_it_is_not_built_before_the_model_loads(shapes_dir, tmp_path):
    with pytest.raises(ConfigError, match="set precision.compile=true"):  # auto may compile nothing
        tiny_sft_config(shapes_dir, tmp_path, "precision.cuda_graphs=true")
    with pytest.raises(ConfigError, match="set precision.cuda_graphs=true too"):
        tiny_sft_config(shapes_dir, tmp_path, "precision.compile=true", "precision.cuda_graphs_vision=true")
    with pytest.raises(ConfigError, match="precision.gradient_checkpointing"):
        tiny_sft_config(shapes_dir, tmp_path, *ON, "precision.gradient_checkpointing=true")
    with pytest.raises(ConfigError, match="packed rows .* data.packing=true"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path / "a", *ON, "data.packing=false"))
    with pytest.raises(ConfigError, match="precision.cuda_graphs runs on one CUDA GPU .* not with device cpu"):
        run_sft(tiny_sft_config(shapes_dir, tmp_path / "b", *ON, "data.packing=true"))
    grpo = load_config(GRPOConfig, None, ["model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}",
                                          "train.device=cpu", f"train.output_dir={tmp_path / 'c'}", *ON])
    with pytest.raises(ConfigError, match="SFT's packed rows, not GRPO"):
        run_grpo(grpo)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before a run began


def test_rows_come_in_steps_of_the_graph_multiple():
    plain = Trainable(None, None, [], None, torch.device("cpu"))
    graphs = Trainable(None, None, [], None, torch.device("cpu"), cuda_graphs=True)
    assert plain.token_multiple == 1 and graphs.token_multiple == CUDA_GRAPH_ROW_MULTIPLE == 256


def test_the_vision_graphs_warn_once_when_image_sizes_vary(monkeypatch):
    """Every new image patch total records the tower's graphs again: after VISION_SHAPES_WARN of them
    the run says so, once; the decoder layers' graphs alone (rows padded to few lengths) never warn."""
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)  # no CUDA here
    batch = lambda patches: {"pixel_values": torch.zeros(patches, 4)}
    both = Trainable(torch.nn.Linear(2, 2), None, [], None, torch.device("cpu"), cuda_graphs=True,
                     cuda_graphs_vision=True)
    said = [cuda_graph_step_begin(both, 1, batch(16 * (i % 3 + 1))) for i in range(20)]  # three sizes
    assert not any(said)
    said = [cuda_graph_step_begin(both, 1, batch(16 * i)) for i in range(1, 20)]
    assert sum(map(bool, said)) == 1 and said.index(next(filter(None, said))) == VISION_SHAPES_WARN - 1  # 16, 32, 48 already met
    assert "precision.cuda_graphs_vision off" in next(filter(None, said))
    assert cuda_graph_step_begin(both, 1, {"pixel_values": None}) is None  # a text-only micro-batch
    layers_only = Trainable(torch.nn.Linear(2, 2), None, [], None, torch.device("cpu"), cuda_graphs=True)
    assert not any(cuda_graph_step_begin(layers_only, 1, batch(16 * i)) for i in range(1, 20))


def test_several_micro_batches_get_their_gradient_buffers_first(monkeypatch):
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    t = Trainable(model, None, [], None, torch.device("cpu"), cuda_graphs=True)
    cuda_graph_step_begin(t, 1, {})
    assert model.weight.grad is None  # one micro-batch: autograd's own buffer is read before the next replay
    cuda_graph_step_begin(t, 2, {})
    assert torch.equal(model.weight.grad, torch.zeros(2, 2)) and model.bias.grad is None


def _losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return {k: v.float() for f in sorted(checkpoint.glob("model*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.gpu
@pytest.mark.parametrize("grad_accum, graphed", [(1, "layers"), (2, "layers"), (2, "layers+vision")])
def test_cuda_graphs_train_to_the_compiled_layers_weights(shapes_dir, tmp_path, grad_accum, graphed, monkeypatch):
    common = ["train.device=cuda", "precision.mode=bf16", "precision.compile=true", "data.packing=true",
              "tiers.method=full", f"train.grad_accum={grad_accum}", "train.max_steps=4", "train.save_every=1",
              "train.keep_last=4", "eval.every=2", "optim.schedule=constant", "tiers.language.lr=1e-3",
              "tiers.projector.lr=1e-3", "tiers.vision.lr=1e-3",
              "tiers.language.dropout=0", "tiers.projector.dropout=0", "tiers.vision.dropout=0"]
    # the compiled run's rows padded as the graphs run pads them: the same shapes, the same kernels
    monkeypatch.setattr(Trainable, "token_multiple", property(lambda self: CUDA_GRAPH_ROW_MULTIPLE))
    plain, graphs = tmp_path / "compiled", tmp_path / "graphs"
    run_sft(tiny_sft_config(shapes_dir, plain, *common))
    vision = ["precision.cuda_graphs_vision=true"] if graphed == "layers+vision" else []
    result = run_sft(tiny_sft_config(shapes_dir, graphs, *common, "precision.cuda_graphs=true", *vision))
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
