"""bench/sft_throughput.compile_layer_groups (an experiment for the host-bound compiled step): grouping
decoder layers and vision blocks into larger compiled regions must leave the model's computation as
it is. Checked with torch.compile stubbed out (the grouping alone; the compiled groups were checked on
the CPU by hand, docs/benchmarks.md), on the tiny model widened so that groups and deepstack
boundaries meet: 9 decoder layers (2 take deepstack features after them), 7 vision blocks, taps
after blocks 1 and 4."""

import copy
import sys
from pathlib import Path

import torch
from transformers import Qwen3VLForConditionalGeneration

from vlforge.data.encode import collate
from vlforge.engine.losses import sft_loss_sum
from vlforge.model.varlen import use_vision_varlen

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from sft_throughput import compile_layer_groups  # noqa: E402


def test_grouped_regions_compute_what_the_layers_do(tiny, shapes_dir, monkeypatch):
    from vlforge.config import DataConfig
    from vlforge.data.dataset import load_dataset

    config = copy.deepcopy(tiny[0].config)
    config.text_config.num_hidden_layers = 9
    config.vision_config.depth, config.vision_config.deepstack_visual_indexes = 7, [1, 4]
    config.vision_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).float()
    use_vision_varlen(model)
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny[1], DataConfig())
    batch = collate([data[i] for i in range(3)], data.encoder.pad_id)

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss, n = sft_loss_sum(m, batch)
        (loss / n).backward()
        return float(loss), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}

    reference = loss_and_grads(copy.deepcopy(model))
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    for k, regions in ((2, 2 + 4 + 4), (3, 2 + 3 + 3), (8, 2 + 1 + 3)):
        grouped = copy.deepcopy(model)
        compiled.clear()
        assert compile_layer_groups(grouped, k, vision=True) == regions == len(compiled)
        layers, blocks = grouped.model.language_model.layers, grouped.model.visual.blocks
        assert layers[0] in compiled and layers[1] in compiled  # deepstack layers: one a region
        assert blocks[2] in compiled and blocks[5] in compiled  # a vision group starts after each tap
        loss, grads = loss_and_grads(grouped)
        assert loss == reference[0]
        assert grads.keys() == reference[1].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[1][name], rtol=0, atol=0, msg=f"k={k}: {name}")
