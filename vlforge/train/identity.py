"""What model a checkpoint was trained from, recorded at save and checked before a resume loads.

Every checkpoint's trainer_state.json holds the run's `model_identity` (Run.start puts it in the
run's state, which every save writes):

    {"method": "lora" | "full",
     "source": {"preset": "tiny", "seed": 0} | {"path": "/abs/model/dir", "weights": "<fingerprint>"},
     "architecture": {"model_type": "qwen3_vl", "summary": "2 layers, hidden 64, ...",
                      "tensors": 123, "parameters": 4567, "sha256": "<names and shapes>"}}

A resume compares it with this run's model before any weight is read (`identity_problem`):
- the architecture (every parameter's name and shape, from the config on the meta device: no
  memory, and the same whatever LoRA, quantization, FP8 or FSDP2 did to the live model) must match;
- with LoRA the checkpoint holds only adapters, trained on one base: that base must be this run's
  (the same preset and model.seed, or a model.path whose weight files have the same fingerprint;
  a model directory moved elsewhere is the same base). A full fine-tuning checkpoint holds the
  whole model, so its architecture is all that must match.
A checkpoint from before this record resumes with a note (nothing to compare).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from vlforge.config import ConfigError, ModelConfig
from vlforge.model.load import check_model_dir, dir_config, model_class
from vlforge.model.presets import preset_config

KEY = "model_identity"  # its key in trainer_state.json

# The base's weight-content fingerprint reads this much of each weight file, not all of it: the
# first 64 KiB (a safetensors header: every tensor's name, dtype, shape, offsets) and 16 windows of
# 4 KiB spread over the rest, ~130 KiB a file, so a resume of an 8B LoRA run reads ~1 MB, not 16 GB.
# Two different fine-tunes of one architecture differ in every window; a change confined to a few
# tensors between the windows would go unseen (a full hash at every start would cost minutes).
_HEAD = 64 * 1024
_WINDOWS, _WINDOW = 16, 4 * 1024


def weight_files(path: str | Path) -> list[Path]:
    """The weight files transformers loads from a model directory: *.safetensors, else *.bin."""
    path = Path(path)
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))


def weights_fingerprint(path: str | Path) -> str:
    """A sampled content fingerprint of a model directory's weight files (names, sizes and the
    bytes described above)."""
    digest = hashlib.sha256()
    for f in weight_files(path):
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}\n".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(_HEAD))
            if size > _HEAD:
                for i in range(_WINDOWS):
                    fh.seek(_HEAD + (size - _HEAD) * i // _WINDOWS)
                    digest.update(fh.read(_WINDOW))
    return digest.hexdigest()


def architecture(config) -> dict:
    """Every parameter's name and shape of the model `config` describes, built on the meta device
    (the transformers class itself says what the architecture holds), as a digest, with counts and a
    readable summary for messages."""
    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    lines = [f"{n}:{list(p.shape)}" for n, p in model.named_parameters()]
    text, vision = config.text_config, config.vision_config
    experts = getattr(text, "num_experts", None)
    summary = (f"{text.num_hidden_layers} layers, hidden {text.hidden_size}, vocab {text.vocab_size}"
               + (f", {experts} experts" if experts else "") + f", vision {vision.depth} blocks")
    return {"model_type": config.model_type, "summary": summary, "tensors": len(lines),
            "parameters": sum(p.numel() for p in model.parameters()),
            "sha256": hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()}


def model_identity(cfg: ModelConfig, method: str, tokenizer) -> dict:
    """This run's identity record (see the module docstring). `tokenizer`: the run's (a preset's
    config takes its vocabulary from it)."""
    if cfg.path:
        path = check_model_dir(cfg.path).resolve()
        source = {"path": str(path), "weights": weights_fingerprint(path)}
        config = dir_config(path)
    else:
        source = {"preset": cfg.preset, "seed": cfg.seed}
        config = preset_config(cfg.preset, tokenizer)
    return {"method": method, "source": source, "architecture": architecture(config)}


def describe(identity: dict) -> str:
    source, arch = identity["source"], identity["architecture"]
    where = (f"model.path={source['path']}" if "path" in source else
             f"model.preset={source['preset']} (model.seed={source['seed']})")
    return f"{where} ({arch['model_type']}: {arch['summary']}, {arch['parameters']:,} parameters)"


def identity_problem(saved: dict, here: dict) -> str | None:
    """Why a checkpoint trained from `saved` cannot resume on this run's model `here`; None: it can."""
    if saved["architecture"]["sha256"] != here["architecture"]["sha256"]:
        what = "another architecture (its parameters' names or shapes differ)"
    elif saved.get("method") != "lora":
        return None  # a full fine-tuning checkpoint brings every weight with it
    elif saved["source"].keys() != here["source"].keys():
        what = "another base model (its LoRA adapters were trained on that base)"
    elif "path" in here["source"]:
        if saved["source"]["weights"] == here["source"]["weights"]:
            return None  # the same weights, wherever the directory is now
        same_dir = saved["source"]["path"] == here["source"]["path"]
        what = ("the same directory, whose weight files changed since" if same_dir else
                "another base model: its weight files differ") + " (its LoRA adapters were trained on that base)"
    elif saved["source"] != here["source"]:
        what = "another base model (a preset's weights are drawn from model.seed; the adapters were trained on those)"
    else:
        return None
    return f"it was trained from {describe(saved)}, and this run's model is {describe(here)}: {what}"


def saved_identity(checkpoint: str | Path) -> dict | None:
    """The identity a checkpoint's trainer_state.json records; None from before the record."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    found = state.get(KEY) if isinstance(state, dict) else None
    return found if isinstance(found, dict) else None


def check_resume_identity(checkpoint: str | Path, here: dict) -> str | None:
    """Refuse (ConfigError) resuming `checkpoint` on another model than `here`, naming both. Returns a
    note for a checkpoint from before the record (nothing to compare), else None."""
    checkpoint = Path(checkpoint)
    saved = saved_identity(checkpoint)
    if saved is None:
        return (f"{checkpoint} records no model identity (saved before vlforge recorded one): that it was trained "
                "from this run's model is not checked")
    try:
        problem = identity_problem(saved, here)
    except (KeyError, TypeError, AttributeError):  # a hand-edited record: the manifest's checksum vouched for it
        raise ConfigError(f"cannot resume from {checkpoint}: its trainer_state.json's {KEY} is malformed; restore "
                          "the file, or resume from another checkpoint") from None
    if problem:
        raise ConfigError(f"cannot resume from {checkpoint}: {problem}. Resume with the model it was trained from "
                          f"(the run's {checkpoint.parent / 'config.yaml'} names it), or start this model in a new "
                          "train.output_dir")
    return None
