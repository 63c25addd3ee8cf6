import json
import os
import random

import pytest
import torch
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small deterministic shapes dataset shared by the tests (read-only)."""
    from vlforge.data.synth import synth_shapes

    out = tmp_path_factory.mktemp("shapes")
    synth_shapes(out, 72, seed=0, val_fraction=8 / 72)
    return out


@pytest.fixture(scope="session")
def tiny():
    """(model, processor) of the tiny preset, fp32, seed 0. Do not train it: copy it first."""
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    return load_model(ModelConfig(preset="tiny"))


@pytest.fixture(scope="module")
def tiny_moe():
    """(model, processor) of the tiny-moe preset, fp32, seed 0, one per test module (the MoE tests
    register router hooks and switch attention implementations on it). Do not train it: copy it first."""
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    return load_model(ModelConfig(preset="tiny-moe"))


@pytest.fixture(scope="module")
def prompts_jsonl(shapes_dir, tmp_path_factory):
    """GRPO prompts of 0-3 images each, of unequal sizes and prompt lengths (test_grpo_packing, test_host_syncs)."""
    out = tmp_path_factory.mktemp("grpo-mixed")
    rng = random.Random(0)
    for name, size in (("wide.png", (96, 64)), ("tall.png", (64, 128))):
        Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)).save(out / name)
    shape = lambda i: str(shapes_dir / "images" / f"{i:06d}.png")
    rows = [
        {"images": [shape(1), str(out / "wide.png")], "text": "Compare the two images.", "answer": "two"},
        {"text": "Say hello without any image, please, in a few words.", "answer": "hello"},
        {"images": [str(out / "tall.png"), shape(2), shape(3)], "text": "How many?", "answer": "3"},
        {"image": shape(4), "text": "What colour is the shape?", "answer": "blue"},
        {"text": "Count to three.", "answer": "one two three"},
    ]
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
