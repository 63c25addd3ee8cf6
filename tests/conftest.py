import os

import pytest
import torch

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
