"""Export a checkpoint as a standard Hugging Face model directory.

    vlforge export runs/x/checkpoint-500 --out merged/ --merge            # LoRA merged into bf16 weights
    vlforge export runs/x/checkpoint-500 --out adapter/                   # adapter only (+ base reference)
    vlforge export runs/x/checkpoint-500 --out merged-nf4/ --merge --quant nf4

The merged directory holds config.json, safetensors shards, generation config, tokenizer,
processor and chat-template files: plain `Qwen3VLForConditionalGeneration.from_pretrained` (MoE:
`Qwen3VLMoeForConditionalGeneration`) and `AutoProcessor.from_pretrained` load it, with no vlforge
installed. MoE expert LoRA (peft parameter targeting) merges into the fused expert weights and a
trained router (peft modules_to_save) replaces the original, so the merged directory is a plain
MoE checkpoint. LoRA is merged in bf16 into
an unquantized base (merging into NF4 weights would round the update away and cannot be saved
as a plain model); quantization is applied afterwards, by loading the merged weights through
transformers' quantizer and saving that.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import torch

from vlforge.config import (ConfigError, ModelConfig, PrecisionConfig, QuantConfig, RunConfig, SFTConfig,
                            load_recipe_config)
from vlforge.model.load import DTYPES, load_model
from vlforge.model.presets import is_moe

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
BASE_FILE = "vlforge_base.json"
SHARDED_DIR = "dcp"  # a sharded (FSDP2) checkpoint's weights and optimizer state: train/checkpoint.py  # an adapter export's base model (what a checkpoint's run config.yaml says)


def run_config(checkpoint: Path) -> RunConfig:
    """The config of the run a checkpoint belongs to: its parent's config.yaml (SFT or GRPO), or,
    for an adapter export, the base model its vlforge_base.json names."""
    base = checkpoint / BASE_FILE
    if base.is_file():
        try:
            info = json.loads(base.read_text())
            return SFTConfig(model=ModelConfig(path=info.get("model.path"), preset=info.get("model.preset"),
                                               seed=info.get("model.seed", 0)),
                             precision=PrecisionConfig(mode=info.get("precision.mode", "bf16")),
                             quant=QuantConfig(**info.get("quant", {})))
        except (json.JSONDecodeError, TypeError, AttributeError) as e:
            raise ConfigError(f"{base}: not a vlforge base description ({e}); re-export the adapter") from None
    path = checkpoint.parent / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a checkpoint's base model is named in its run's config.yaml "
                          f"(or, for an adapter export, in {BASE_FILE})")
    return load_recipe_config(path, run=True)


def is_sharded(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / SHARDED_DIR).is_dir()


def consolidate_sharded(checkpoint: Path, dtype: torch.dtype = torch.float32):
    """(model, processor) of a sharded checkpoint, in this one process (no process group needed):
    the run's base with its plan applied, the saved weights loaded into it, LoRA merged."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoProcessor

    from vlforge.model.safe_load import SafeLoadPlanner, SafeReader, read_metadata
    from vlforge.model.tiers import apply_plan, build_plan

    run = run_config(checkpoint)
    model, _ = load_model(run.model, dtype=torch.float32)
    model = apply_plan(model, build_plan(model, run.tiers))
    # a checkpoint someone hands us: DCP's own reader would unpickle its .metadata (model/safe_load.py)
    metadata = read_metadata(checkpoint / SHARDED_DIR)
    saved = {k.removeprefix("model.") for k in metadata.state_dict_metadata if k.startswith("model.")}
    state = {k: v for k, v in model.state_dict().items() if k in saved}
    if missing := saved - set(state):
        raise ConfigError(f"{checkpoint}: weights {sorted(missing)[:3]} do not exist in the run's model "
                          "(its config.yaml changed since?)")
    dcp.load({"model": state}, storage_reader=SafeReader(str(checkpoint / SHARDED_DIR)), planner=SafeLoadPlanner())
    model.load_state_dict(state, strict=False)
    if run.tiers.method == "lora":
        model = model.merge_and_unload()
    return model.to(dtype), AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)


def _check_checkpoint(checkpoint: Path) -> str:
    if not checkpoint.is_dir():
        raise ConfigError(f"{checkpoint} is not a directory (expected runs/NAME/checkpoint-STEP)")
    if is_sharded(checkpoint):
        return "sharded"
    if (checkpoint / "adapter_config.json").is_file():
        return "lora"
    if (checkpoint / "config.json").is_file():
        return "full"
    raise ConfigError(f"{checkpoint} has neither adapter_config.json (LoRA) nor config.json (full weights)")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} is not empty; choose another --out or pass --overwrite")


def _prepare_out(out: Path, overwrite: bool) -> None:
    _check_out(out, overwrite)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)


def load_lora_checkpoint(checkpoint: Path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                         quant: QuantConfig | None = None):
    """(peft model, processor, quant): the run's base with the checkpoint's adapter on top, unmerged.

    `quant=None` means the run's own `quant` (a QLoRA adapter on its NF4 base); pass QuantConfig()
    for an unquantized base. A preset's random base is only the run's base when drawn in the run's
    dtype, so it is built in that dtype and cast afterwards.
    """
    from peft import PeftModel

    run = run_config(checkpoint)
    quant = run.quant if quant is None else quant
    base_dtype = DTYPES[run.precision.mode] if run.model.preset and not run.model.path else dtype

    def adapter(base):  # on the plain experts, before load_model quantizes them (model/quant.py)
        return PeftModel.from_pretrained(base if quant.enabled else base.to(dtype), str(checkpoint), is_trainable=False)

    model, processor = load_model(run.model, dtype=base_dtype, device=device, quant=quant, wrap=adapter)
    processor = saved_processor(checkpoint, processor)
    # expert LoRA served as the run trained it (no folded expert copies); on NF4 experts always fused:
    # peft's own forward stacks its update on their parametrization and never removes it
    if run.tiers.expert_lora == "fused" or quant.expert_method != "none":
        from vlforge.model.moe_lora import fuse_expert_lora

        fuse_expert_lora(model)
    return model, processor, quant


def saved_processor(checkpoint: Path, base_processor):
    """The processor a checkpoint saved (its run's, with the run's image and video limits:
    data/encode.record_limits), else `base_processor` (a checkpoint saved without one)."""
    if not any((checkpoint / name).is_file() for name in ("processor_config.json", "preprocessor_config.json")):
        return base_processor
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)


def load_merged(checkpoint: Path, dtype: torch.dtype = torch.bfloat16):
    """(model, processor) with LoRA merged into an unquantized base, or the full checkpoint's weights."""
    from transformers import AutoProcessor

    from vlforge.model.load import dir_config, model_class

    kind = _check_checkpoint(checkpoint)
    if kind == "sharded":
        return consolidate_sharded(checkpoint, dtype)
    if kind == "full":  # dense or MoE, as its config.json says
        model = model_class(dir_config(checkpoint)).from_pretrained(str(checkpoint), dtype=dtype, local_files_only=True)
        return model, AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    # never into a quantized base, even for a QLoRA run: the update would be rounded away
    model, processor, _ = load_lora_checkpoint(checkpoint, torch.float32, quant=QuantConfig())
    return model.merge_and_unload().to(dtype), processor


def export(checkpoint: str | Path, out: str | Path, *, merge: bool = False, quant: QuantConfig | None = None,
           dtype: torch.dtype = torch.bfloat16, overwrite: bool = False, device: str | torch.device = "cpu") -> dict:
    """Write `out`; returns {"out", "kind", "quant", "files"}. `device`: where a --quant reload
    runs (bitsandbytes / torchao quantize there; the caller checks it can, train.hardware)."""
    checkpoint, out = Path(checkpoint), Path(out)
    kind = _check_checkpoint(checkpoint)
    quant = quant or QuantConfig()
    if kind == "lora" and not merge:
        if quant.enabled:
            raise ConfigError("--quant needs --merge for a LoRA checkpoint (an adapter has no base weights to quantize)")
        _prepare_out(out, overwrite)
        return _export_adapter(checkpoint, out)
    _check_out(out, overwrite)
    if quant.enabled and quant.expert_method != "none" and is_moe(_checkpoint_config(checkpoint, kind)):
        raise ConfigError(f"export --quant: {checkpoint} is an MoE model, whose NF4 experts are bitsandbytes "
                          "parametrizations that a plain transformers load cannot read back; export without "
                          "--quant (bf16) and load that with --quant nf4 (infer, serve), which quantizes the "
                          "experts as it loads")
    model, processor = load_merged(checkpoint, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))  # renamed into place when complete
    try:
        if quant.enabled:  # transformers' quantizers act as weights load: save plain, reload quantized
            with tempfile.TemporaryDirectory() as plain:
                _save(model, processor, Path(plain))
                del model
                quantized, processor = load_model(ModelConfig(path=plain), dtype=dtype, device=device, quant=quant)
                _save(quantized, processor, staging)
        else:
            _save(model, processor, staging)
        _umask_modes(staging)
        if out.exists():  # only now, with the new export complete, does an --overwrite'd one go
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = sorted(p.name for p in out.iterdir())
    name = {"lora": "merged", "sharded": "consolidated"}.get(kind, "full")
    return {"out": str(out), "kind": name, "quant": _quant_name(quant), "files": files}


def _checkpoint_config(checkpoint: Path, kind: str):
    """The model config of a checkpoint without loading weights: a full one's config.json, else its run's."""
    from vlforge.model.load import build_meta_model, dir_config

    if kind == "full":
        return dir_config(checkpoint)
    return build_meta_model(run_config(checkpoint).model)[0].config


def _save(model, processor, out: Path) -> None:
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.save_pretrained(out, max_shard_size="5GB")
    processor.save_pretrained(out)


def _export_adapter(checkpoint: Path, out: Path) -> dict:
    """The adapter, the processor files, and which base model it belongs to."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copy2(checkpoint / name, out / name)
    from transformers import AutoProcessor

    AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True).save_pretrained(out)
    cfg = run_config(checkpoint)
    # what loading the adapter needs of its run: the base, the dtype a preset base was drawn in, and
    # the quantized base of a QLoRA run (infer/serve load it as they load a checkpoint)
    (out / BASE_FILE).write_text(json.dumps(
        {"model.path": cfg.model.path, "model.preset": cfg.model.preset, "model.seed": cfg.model.seed,
         "precision.mode": cfg.precision.mode, "quant": dataclasses.asdict(cfg.quant),
         "note": "load with peft: PeftModel.from_pretrained(base_model, this_dir)"}, indent=2))
    _umask_modes(out)
    return {"out": str(out), "kind": "adapter", "quant": "none", "files": sorted(p.name for p in out.iterdir())}


def _umask_modes(root: Path) -> None:
    """The modes a plain mkdir/open would give (0755/0644 under umask 022): mkdtemp makes the
    staging directory 0700 and safetensors writes weights 0600, which other users of a shared
    machine could not read."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    root.chmod(0o777 & ~mask)
    for p in root.rglob("*"):
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _quant_name(q: QuantConfig) -> str:
    return "none" if not q.enabled else ",".join(f"{g}={getattr(q, g)}" for g in ("language", "vision", "projector")
                                                 if getattr(q, g) != "none")
