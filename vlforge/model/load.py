"""Load a Qwen3-VL model + processor from a local directory or a built-in preset. Never downloads.

The architecture follows the config: `model_type` qwen3_vl is the dense
`Qwen3VLForConditionalGeneration`, qwen3_vl_moe the mixture-of-experts
`Qwen3VLMoeForConditionalGeneration` (30B-A3B, 235B-A22B). MoE experts run with
`model.experts_implementation` (auto: transformers' grouped GEMM on CUDA, its reference loop elsewhere).
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import AutoProcessor, Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

from vlforge.config import ConfigError, ModelConfig, QuantConfig
from vlforge.model.presets import PRESETS, TINY_PATCH, TINY_PRESETS, build_processor, is_moe, preset_config, tiny_tokenizer
from vlforge.model.quiet import offline_and_quiet
from vlforge.model.varlen import use_vision_varlen

# The dtype names of the config (precision.mode, --dtype) as torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _offline() -> None:
    """Nothing in vlforge may reach the hub at run time, nor print library notices a user cannot
    act on (model/quiet.py says which). Set where models and processors load (not at import), so
    importing vlforge changes no process-wide setting."""
    offline_and_quiet()


def check_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model.path: {path} is not a directory. Point it at a local HF-format "
                          "Qwen3-VL folder (config.json, *.safetensors, tokenizer and preprocessor files).")
    missing = [f for f in ("config.json",) if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors")
    if missing:
        raise ConfigError(f"model.path: {path} has no {', '.join(missing)}; is it an HF-format Qwen3-VL directory?")
    return path


def load_processor(cfg: ModelConfig):
    _offline()
    if cfg.path:
        return AutoProcessor.from_pretrained(str(check_model_dir(cfg.path)), local_files_only=True)
    if cfg.preset in TINY_PRESETS:
        return build_processor(tiny_tokenizer(), TINY_PATCH)
    return build_processor(tiny_tokenizer(), 16)


ARCHITECTURES = {"qwen3_vl": Qwen3VLForConditionalGeneration, "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration}


def dir_config(path: str | Path):
    """The model config of a local directory, its architecture checked (dense or MoE Qwen3-VL)."""
    from transformers import AutoConfig

    path = check_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"model.path: {path}/config.json is not a config transformers reads ({e})") from None
    if config.model_type not in ARCHITECTURES:
        raise ConfigError(f"model.path: {path}/config.json has model_type '{config.model_type}'; vlforge loads "
                          f"Qwen3-VL ({' or '.join(ARCHITECTURES)}) models")
    return config


def model_class(config) -> type:
    return ARCHITECTURES["qwen3_vl_moe" if is_moe(config) else "qwen3_vl"]


def experts_implementation(cfg: ModelConfig, device: torch.device) -> str:
    """transformers' expert kernels: `grouped_mm` (one grouped GEMM per projection over every
    expert's tokens) is the fastest it offers and its own default since 5.1x; auto picks it on
    CUDA and the reference Python loop over experts (`eager`) elsewhere, where grouped_mm's CPU path
    brings nothing and eager is the numerics the parity tests compare against."""
    if cfg.experts_implementation != "auto":
        return cfg.experts_implementation
    return "grouped_mm" if device.type == "cuda" else "eager"


def attention_problem(attn: str, cls: type) -> str | None:
    """Why `model.attention.implementation` cannot run for this model class (None: it can); transformers
    would raise a ValueError / ImportError from deep inside from_pretrained instead."""
    if attn == "flex_attention" and not getattr(cls, "_supports_flex_attn", False):
        return (f"model.attention.implementation=flex_attention: transformers' {cls.__name__} does not support "
                "flex_attention (its MoE sibling does); use sdpa (packed rows then attend through a block-"
                "diagonal mask) or flash_attention_2 (pip install flash-attn: varlen kernels for packed rows)")
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "model.attention.implementation=flash_attention_2 needs the flash-attn package: pip install flash-attn"
    return None


def _impl_kwargs(cfg: ModelConfig, config, device: torch.device) -> dict:
    if problem := attention_problem(cfg.attention.implementation, model_class(config)):
        raise ConfigError(problem)
    kwargs = {"attn_implementation": cfg.attention.implementation}
    if is_moe(config):
        kwargs["experts_implementation"] = experts_implementation(cfg, device)
    return kwargs


def load_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quant: QuantConfig | None = None, wrap: Callable[[nn.Module], nn.Module] | None = None):
    """Returns (model, processor). `path` wins over `preset`; presets are randomly initialised from `cfg.seed`.

    With `quant` enabled the weights go through transformers' quantizer (bitsandbytes / torchao)
    as they load, and an MoE's experts through model/quant.quantize_experts, with exactly the
    weights of model/quant.py's plan quantized (checked). Callers check first that the device can
    run it (train.hardware.quant_problem). `wrap` (peft's LoRA: returns the wrapped model) runs on
    the loaded model before its experts are quantized, and the result is what comes back.
    """
    _offline()
    if not cfg.path and not cfg.preset:
        raise ConfigError(f"set model.path (a local Qwen3-VL directory) or model.preset ({', '.join(PRESETS)})")
    if quant is not None and quant.enabled:
        return _load_quantized(cfg, quant, dtype, torch.device(device), wrap)
    processor = load_processor(cfg)
    target = torch.device(device)
    if cfg.path:
        config = dir_config(cfg.path)
        model = model_class(config).from_pretrained(
            str(check_model_dir(cfg.path)), dtype=dtype, local_files_only=True,
            device_map=str(device) if str(device) != "cpu" else None, **_impl_kwargs(cfg, config, target))
    else:
        config = preset_config(cfg.preset, processor.tokenizer)
        cuda = [target.index or 0] if target.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # the init seed must not reset the run's own RNG stream
            torch.manual_seed(cfg.seed)
            with torch.device(device):
                model = model_class(config)._from_config(config, dtype=dtype, **_impl_kwargs(cfg, config, target))
    _generation_tokens(model, processor)
    _vision_attention(cfg, model)
    return (wrap(model) if wrap else model), processor


def _vision_attention(cfg: ModelConfig, model) -> None:
    if cfg.attention.vision != "sdpa":  # auto: varlen too (training may switch back: train/trainable)
        use_vision_varlen(model)


def _generation_tokens(model, processor) -> None:
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.eos_token_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")


def _load_quantized(cfg: ModelConfig, quant: QuantConfig, dtype: torch.dtype, device: torch.device,
                    wrap: Callable[[nn.Module], nn.Module] | None):
    from vlforge.model.quant import expert_modules, from_pretrained_kwargs, quant_plan, quantize_experts, verify
    from vlforge.model.tiers import unwrap

    if cfg.path is None:  # quantizers act at from_pretrained: a preset goes through a directory
        model, processor = load_model(cfg, dtype=dtype, device=device)  # random init is fastest on the GPU
        with tempfile.TemporaryDirectory() as tmp:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                _save_local(model, Path(tmp))  # this rank's own copy
            else:  # in 5 GB shards: one shard's bytes in host memory at a time (a 30B preset is 62 GB)
                model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return _load_quantized(ModelConfig(path=tmp, attention=cfg.attention,
                                               experts_implementation=cfg.experts_implementation), quant, dtype, device, wrap)
    meta, processor = build_meta_model(cfg)
    experts = quant.expert_method != "none" and bool(expert_modules(meta))
    if quant.experts == "nf4" and not is_moe(meta.config):
        raise ConfigError(f"quant.experts=nf4: {cfg.path} is a dense model, it has no experts to quantize; "
                          "leave quant.experts at auto")
    kwargs = from_pretrained_kwargs(quant, quant_plan(meta, quant), compute_dtype=dtype)
    # Quantized experts load staged: the whole model into host memory first (a checkpoint stored in
    # the load dtype stays views of the memory-mapped safetensors: file pages, no copy), then one
    # expert stack at a time to the GPU, quantized there (quantize_experts), so the GPU never holds
    # the bf16 experts (58 GB for 30B-A3B) that its NF4 ones replace (15 GB). transformers' loader
    # cannot leave only the experts in host memory: a mixed device_map offloads them behind hooks.
    staged = experts and device.type != "cpu"
    # "cpu" said, not left out: without a device_map, transformers' bitsandbytes quantizer puts the
    # model on the GPU whenever there is one (found on an H100: a CPU load with every tensor but our
    # expert stacks on cuda:0)
    device_map = "cpu" if staged or device.type == "cpu" else str(device) if device.type == "cuda" else None
    model = model_class(meta.config).from_pretrained(
        str(check_model_dir(cfg.path)), dtype=dtype, local_files_only=True, device_map=device_map,
        **_impl_kwargs(cfg, meta.config, device), **kwargs)
    _generation_tokens(model, processor)
    _vision_attention(cfg, model)
    model = wrap(model) if wrap else model  # peft must see the experts plain (model/quant.py)
    if experts:
        quantize_experts(model, device)
    if staged:
        model.to(device)
        unwrap(model).hf_device_map = {"": str(device)}
    verify(model, quant)  # the skip list must have been exact, and every expert quantized
    return model, processor


def _save_local(model, out: Path) -> None:
    """The model as an HF directory written by this process, whatever its rank: transformers' own
    save_pretrained (5.2x) writes only on rank 0 once torch.distributed is initialized, which left
    the other DDP ranks' private copy of a quantized preset empty. One file, serialized whole in
    host memory (safetensors' save_model; it keeps tied weights once)."""
    from safetensors.torch import save_model

    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})  # tied weights once


def build_meta_model(cfg: ModelConfig, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """The model's module tree and shapes without allocating weights: for `--plan` on 8B or
    30B-A3B on a laptop, and for sharded loading (train/sharding.materialize fills its
    shards), where `dtype` and `device` (the one it will run on: it picks the attention and expert
    kernels) make it the model load_model would build there."""
    processor = load_processor(cfg)
    config = dir_config(cfg.path) if cfg.path else preset_config(cfg.preset, processor.tokenizer)
    kwargs = {} if device is None else {"dtype": dtype, **_impl_kwargs(cfg, config, torch.device(device))}
    with torch.device("meta"):
        model = model_class(config)._from_config(config, **kwargs)
    if device is not None:
        _generation_tokens(model, processor)
        _vision_attention(cfg, model)
    return model, processor


def stored_dtype(path: str | Path) -> torch.dtype | None:
    """The one floating dtype a local directory's safetensors hold every weight in (bf16 for the
    published Qwen3-VL), or None: mixed, another (FP8) or no safetensors. Reads headers only."""
    from safetensors import safe_open

    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    found = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            found |= {f.get_slice(key).get_dtype() for key in f.keys()}
    floats = {d for d in found if d.startswith(("F", "BF"))}
    return names.get(floats.pop()) if len(floats) == 1 else None


def host_dtype(cfg: ModelConfig, dtype: torch.dtype, full: bool) -> torch.dtype:
    """The dtype rank 0 reads the weights in for sharded loading, for a run that loads them in
    `dtype`: full fine-tuning (`full`) of a checkpoint stored narrower (bf16 under fp32 masters)
    reads them as stored, half the host memory, and the shards' cast up is exact. Not with LoRA:
    peft rounds new adapters to the base's dtype before making them fp32."""
    stored = stored_dtype(cfg.path) if full and cfg.path else None
    return stored if stored is not None and stored.itemsize < dtype.itemsize else dtype


def load_on_host(cfg: ModelConfig, dtype: torch.dtype):
    """load_model's weights in host memory, exactly (a preset: the same seeded initialisation as
    load_model on the CPU): what rank 0 sends the other ranks under sharded loading. Nothing
    runs on it, so it takes the sdpa attention whatever the run uses (flash-attn wants a GPU)."""
    return load_model(replace(cfg, attention=replace(cfg.attention, implementation="sdpa")), dtype=dtype, device="cpu")[0]
