"""The doctor's recipe checks: what a training config asks of this machine (device, bf16, FP8 and
its backend, quantization, flash-attention, liger, packing, CUDA graphs, tools, a local model
directory, the optimizer), failed when the machine cannot give it, and what its `distributed`
section does in this launch (the strategy as train/distributed.init_world resolves it, and what
is refused under FSDP2), each refused as the run would refuse it before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlforge.config import ConfigError, GRPOConfig, SFTConfig
from vlforge.doctor.devices import LIBRARY_BY_NAME
from vlforge.doctor.environment import Check, one_line, try_import
from vlforge.doctor.launch import parse_launch
from vlforge.train.hardware import bf16_problem, fp8_problem
from vlforge.train.runtime import choose_device

# The module each recipe feature imports: narrower than the top-level package, so a package
# whose top level imports but whose torch extension does not is still caught.
_BACKEND_MODULE = {"torchao": "torchao.float8", "te": "transformer_engine.pytorch"}
_BACKEND_LIBRARY = {"torchao": "torchao", "te": "transformer_engine"}


@dataclass
class Recipe:
    """What a training config asks of the machine."""

    config: str | None
    device_spec: str  # train.device as written
    device: torch.device | None  # what it resolves to here; None when it cannot
    device_problem: tuple[str, str] | None  # (detail, advice)
    bf16: bool
    fp8_backend: str | None  # "torchao" | "te" when precision.fp8.enabled
    flash_attn: bool
    model_path: str | None
    quant: frozenset[str] = frozenset()  # quant methods in use: nf4 / int8 (bitsandbytes), fp8 (torchao)
    loss_impl: str = "auto"  # loss.impl: liger needs liger-kernel and CUDA (and SFT: GRPO refuses it)
    grpo: bool = False
    packing: bool | str = False  # data.packing (SFT): auto packs where the varlen flash kernel runs
    precision_mode: str = "bf16"
    attn_implementation: str = "sdpa"
    cuda_graphs_detail: str | None = None  # compile.cuda_graphs: what it graphs here, or why it is refused
    cuda_graphs_ok: bool = True
    tools: str | None = None  # GRPO tools.names: the tools loaded, or why they cannot run
    tools_ok: bool | None = True  # None: not checked (the model's processor did not load)

    @property
    def needs(self) -> list[str]:
        needs = ["device"]
        if self.bf16:
            needs.append("bf16")
        if self.fp8_backend:
            needs += ["fp8", _BACKEND_LIBRARY[self.fp8_backend]]
        if self.quant & {"nf4", "int8"}:
            needs.append("bitsandbytes")
        if "fp8" in self.quant:
            needs += ["quant fp8", "torchao"]
        if self.flash_attn:
            needs.append("flash_attn")
        if self.model_path:
            needs.append("model.path")
        return needs


def recipe_from_config(cfg: SFTConfig | GRPOConfig, config: str | None, cuda_available: bool,
                       gpu_count: int) -> Recipe:
    device, problem = choose_device(cfg.train.device, cuda_available, gpu_count)
    graphs, graphs_ok = None, True
    if cfg.compile.cuda_graphs and device is not None:  # the refusal setup_model makes before loading
        from vlforge.train.trainable import cuda_graphs_problem

        graphs = cuda_graphs_problem(cfg, device)
        graphs_ok = graphs is None
        graphs = graphs or ("compile.cuda_graphs: the compiled decoder layers"
                            + (" and vision blocks" if cfg.compile.cuda_graphs_vision else "")
                            + " replay as CUDA graphs, on packed rows padded to multiples of 256 tokens")
    tools, tools_ok = None, True
    if isinstance(cfg, GRPOConfig) and cfg.tools.names:  # run_grpo's check, before any model loads
        from vlforge.tools.calls import ToolCall
        from vlforge.tools.runner import ToolProcesses
        from vlforge.rollout.multiturn import rollout_tools

        try:
            loaded = rollout_tools(cfg)
            if cfg.tools.processes:  # a worker process loads them as the run's will (one call through it)
                with ToolProcesses(loaded, 1) as run:
                    run([[ToolCall(None, {}, "a doctor check")]], loaded, 60.0)
            tools = (f"tools.names: {', '.join(loaded)} (the chat template renders their turns"
                     + ("; a worker process loads them" if cfg.tools.processes else "") + ")")
        except ConfigError as e:
            if not str(e).startswith("tools.names"):  # the model's processor did not load: "recipe model.path" says why
                tools, tools_ok = f"tools.names: the chat template not checked ({e})", None
            else:
                tools, tools_ok = str(e), False
    return Recipe(
        config=config,
        device_spec=cfg.train.device,
        device=device,
        device_problem=problem,
        bf16=cfg.precision.mode == "bf16",
        fp8_backend=cfg.precision.fp8.backend if cfg.precision.fp8.enabled else None,
        flash_attn=cfg.model.attention.implementation == "flash_attention_2",
        model_path=cfg.model.path,
        quant=frozenset({cfg.quant.language, cfg.quant.vision, cfg.quant.projector, cfg.quant.expert_method} - {"none"}),
        loss_impl=cfg.loss.impl,
        grpo=isinstance(cfg, GRPOConfig),
        packing=False if isinstance(cfg, GRPOConfig) else cfg.data.packing,  # GRPO packs by rl.packing
        attn_implementation=cfg.model.attention.implementation,
        precision_mode=cfg.precision.mode,
        cuda_graphs_detail=graphs,
        cuda_graphs_ok=graphs_ok,
        tools=tools,
        tools_ok=tools_ok,
    )


def _split(message: str) -> tuple[str, str]:
    """A refusal's message as (what is wrong, what to do): vlforge's messages put them either side
    of the first ': '."""
    what, _, todo = message.partition(": ")
    return (what, todo) if todo else (message, "")


def distributed_recipe_checks(cfg: SFTConfig | GRPOConfig, env: dict[str, Any], recipe: Recipe) -> list[Check]:
    """What the recipe's `distributed` and `optim` sections do in this launch, refused as the run
    would refuse them (before any model loads), without initialising anything."""
    from vlforge.train.distributed import World, planned_strategy, refuse_unsupported
    from vlforge.train.optim import optimizer_problem

    launch = parse_launch(env.get("_launch", {}))
    size = launch.world_size if launch.torchrun else 1
    d = cfg.distributed
    strategy, problem = planned_strategy(d.strategy, size, cfg.train.device)
    values = {"strategy": d.strategy, "resolved": strategy, "world_size": size}
    checks = []
    if problem:
        checks.append(Check("recipe distributed", "fail", *_split(problem), values))
    elif strategy == "none":
        if d.cpu_offload:
            checks.append(Check("recipe distributed", "warn", f"distributed.strategy={d.strategy} on one process "
                                "means none: distributed.cpu_offload=true is ignored",
                                "set distributed.strategy=fsdp2 to offload on one process", values))
        else:
            checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> none: one "
                                "process, no sharding", values=values))
    elif strategy == "ddp":
        checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> ddp over {size} "
                            "process(es) (a full replica of the model and its training state on each)", values=values))
    else:
        how = ", ".join(["reshard_after_forward" if d.reshard_after_forward else "gathered weights kept after "
                         "forward", "cpu_offload" if d.cpu_offload else "no cpu offload"])
        checks.append(Check("recipe distributed", "ok", f"distributed.strategy={d.strategy} -> fsdp2 over {size} "
                            f"process(es) ({how})", values=values))
    sharded = strategy == "fsdp2"
    if sharded:
        try:
            refuse_unsupported(cfg, World(size=size, strategy=strategy))
        except ConfigError as e:
            checks.append(Check("recipe fsdp2", "fail", *_split(str(e))))
        else:
            checks.append(Check("recipe fsdp2", "ok", "nothing this recipe uses is refused under FSDP2"))
    if recipe.device is None:
        checks.append(Check("recipe optimizer", "skip", "train.device is unusable (see recipe device)"))
    elif opt := optimizer_problem(cfg.optim, recipe.device.type):
        checks.append(Check("recipe optimizer", "fail", *_split(opt), {"optimizer": cfg.optim.name}))
    else:
        checks.append(Check("recipe optimizer", "ok", f"optim.name={cfg.optim.name} runs on {recipe.device}"
                            + (" with FSDP2" if sharded else ""), values={"optimizer": cfg.optim.name}))
    return checks


def _device_feature_check(name: str, device: torch.device | None, problem: str | None, ok: str, failed: str,
                          advice: str | None = None) -> Check:
    """A recipe feature the run's device must have (bf16, FP8). With no usable device there is
    nothing to ask: "recipe device" has failed already, and judging the CPU instead would mislead."""
    if device is None:
        return Check(name, "skip", "train.device is unusable (see recipe device)")
    if problem:
        return Check(name, "fail", failed, advice or problem)
    return Check(name, "ok", ok)


def _library_feature_check(lib: str, feature: str, error: str | None, instead: str, module: str | None = None,
                           version: str | None = None) -> Check:
    """A library a recipe feature imports: ok when it imports, else fail with how to install it
    and what to use instead."""
    module = module or lib
    if error is None:
        return Check(f"recipe {lib}", "ok", f"{feature}: {module} {version + ' ' if version else ''}imports")
    return Check(f"recipe {lib}", "fail", f"{feature} needs {module}: {one_line(error)}",
                 f"{LIBRARY_BY_NAME[lib].install}; or {instead}", {"error": error})


def recipe_checks(recipe: Recipe, libs: dict[str, dict[str, Any]]) -> list[Check]:
    """What the recipe needs, in the order a run meets it: its device, precision and quantization,
    kernels, tools and model directory."""
    checks = [_device_check(recipe)] + _precision_checks(recipe, libs) + _kernel_checks(recipe, libs)
    if recipe.tools:
        checks.append(Check("recipe tools", "ok", recipe.tools) if recipe.tools_ok else
                      Check("recipe tools", "skip", recipe.tools) if recipe.tools_ok is None else
                      Check("recipe tools", "fail", recipe.tools, "fix tools.names (README: Tools: multi-turn rollouts)"))
    if recipe.model_path:
        checks.append(_model_path_check(recipe.model_path))
    return checks


def _device_check(recipe: Recipe) -> Check:
    device = recipe.device
    if recipe.device_problem:
        detail, advice = recipe.device_problem
        return Check("recipe device", "fail", detail, advice, {"train_device": recipe.device_spec})
    via = f"train.device={recipe.device_spec} -> {device}"
    if recipe.device_spec == "auto" and device.type == "cpu":
        via += " (no GPU visible)"
    if device.type not in ("cpu", "cuda"):
        return Check("recipe device", "warn", via, "vlforge is tested on cpu and cuda devices only",
                     {"train_device": recipe.device_spec})
    return Check("recipe device", "ok", via, values={"train_device": recipe.device_spec})


def _precision_checks(recipe: Recipe, libs: dict[str, dict[str, Any]]) -> list[Check]:
    """bf16, FP8 training and its backend, quantized weights and their libraries."""
    checks = []
    device = recipe.device
    # asked only when the recipe uses FP8: a device's capability is read from the driver
    fp8_missing = fp8_problem(device) if device is not None and (recipe.fp8_backend or "fp8" in recipe.quant) else None

    if recipe.bf16:
        checks.append(_device_feature_check(
            "recipe bf16", device, bf16_problem(device) if device is not None else None,
            f"precision.mode=bf16 runs on {device}" + (" (slowly)" if device and device.type == "cpu" else ""),
            f"precision.mode=bf16 on {device}: no bf16 support"))

    if recipe.fp8_backend:
        checks.append(_device_feature_check(
            "recipe fp8", device, fp8_missing, f"precision.fp8.enabled: {device} has FP8 tensor cores",
            f"precision.fp8.enabled on {device}: no FP8 support"))
        name, module = _BACKEND_LIBRARY[recipe.fp8_backend], _BACKEND_MODULE[recipe.fp8_backend]
        error = try_import(module) if libs[name]["available"] else libs[name]["error"]
        other = "te" if recipe.fp8_backend == "torchao" else "torchao"
        checks.append(_library_feature_check(
            name, f"precision.fp8.backend={recipe.fp8_backend}", error,
            f"use precision.fp8.backend={other}, or precision.fp8.enabled=false", module=module))

    if recipe.quant & {"nf4", "int8"}:
        info = libs["bitsandbytes"]
        checks.append(_library_feature_check(
            "bitsandbytes", f"quant {'/'.join(sorted(recipe.quant & {'nf4', 'int8'}))}", info["error"],
            "set quant.language=none", version=info["version"]))

    if "fp8" in recipe.quant:
        checks.append(_device_feature_check(
            "recipe quant fp8", device, fp8_missing, f"quant fp8: {device} has FP8 tensor cores",
            f"quant fp8 on {device}: no FP8 support",
            "quant fp8 needs compute capability >= 8.9 (L4, L40, H100, H200, B200): use quant nf4 or int8"))
        info = libs["torchao"]
        checks.append(_library_feature_check("torchao", "quant fp8", info["error"], "use quant nf4 or int8",
                                             version=info["version"]))
    return checks


def _kernel_checks(recipe: Recipe, libs: dict[str, dict[str, Any]]) -> list[Check]:
    """The kernels the recipe picks: flash-attention, liger's loss, packed rows' varlen attention,
    CUDA graphs."""
    checks = []
    device = recipe.device
    if recipe.flash_attn:
        info = libs["flash_attn"]
        checks.append(_library_feature_check(
            "flash_attn", "model.attention.implementation=flash_attention_2", info["error"],
            "use model.attention.implementation=sdpa", version=info["version"]))

    if recipe.loss_impl == "liger" and device is not None:  # the check setup_model makes before loading
        from vlforge.config import LossConfig
        from vlforge.train.losses import loss_impl_problem

        problem = ("loss.impl=liger: GRPO's log-probs need banned vision tokens and the entropy, which liger's "
                   "fused op cannot give" if recipe.grpo else loss_impl_problem(LossConfig(impl="liger"), device))
        checks.append(Check("recipe loss", "fail", problem, "set loss.impl=auto (ours, chunked)")
                      if problem else
                      Check("recipe loss", "ok", f"loss.impl=liger: liger-kernel's fused cross-entropy on {device}"))

    if recipe.packing == "auto" and device is not None:  # what the recipe will do; informational
        from vlforge.train.packed_attention import packing_problem

        problem = packing_problem(device, recipe.attn_implementation, recipe.precision_mode)
        checks.append(Check("recipe packing", "ok", f"data.packing=auto -> padded rows: {problem}" if problem else
                            f"data.packing=auto -> packed rows on {device} (torch's varlen flash kernel)"))

    if recipe.cuda_graphs_detail:
        checks.append(Check("recipe cuda graphs", "ok", recipe.cuda_graphs_detail) if recipe.cuda_graphs_ok else
                      Check("recipe cuda graphs", "fail", recipe.cuda_graphs_detail, "set compile.cuda_graphs=false"))
    return checks


def _model_path_check(path: str) -> Check:
    where = Path(path).expanduser()
    advice = ("point model.path at a local Hugging Face-format Qwen3-VL directory (config.json, "
              "*.safetensors, tokenizer and preprocessor files); vlforge never downloads weights")
    values = {"path": str(where)}
    if not where.is_dir():
        return Check("recipe model.path", "fail", f"model.path={path}: no such directory", advice, values)
    if not (where / "config.json").is_file():
        return Check("recipe model.path", "fail", f"model.path={path}: has no config.json", advice, values)
    if not any(where.glob("*.safetensors")) and not any(where.glob("*.bin")):
        return Check("recipe model.path", "warn", f"model.path={path}: config.json but no *.safetensors weights",
                     "copy the weight files into it (an incomplete download?)", values)
    return Check("recipe model.path", "ok", f"model.path={path}: config.json and weights found", values=values)
