"""Supervised fine-tuning of Qwen3-VL: LoRA tiers or full, one readable step loop.

    vlforge sft configs/demo-sft.yaml
    vlforge sft configs/qwen3vl-8b-lora.yaml model.path=/weights/Qwen3-VL-8B-Instruct data.train=train.jsonl

Per optimizer step: `grad_accum` micro-batches, each loss a *sum* of token cross-entropies divided
by the number of supervised tokens in the whole accumulated batch, so the update is the same for
batch 8 x accum 1 and batch 2 x accum 4. Then unscale (fp16 only), clip, step, schedule.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from vlforge.config import SFTConfig, ConfigError, dump_config
from vlforge.data.dataset import SFTDataset, batches_from, load_dataset
from vlforge.data.encode import collate
from vlforge.engine.checkpoint import load_checkpoint, save_checkpoint
from vlforge.engine.fp8 import fp8_backend, fp8_layer_plan
from vlforge.engine.hardware import bf16_problem
from vlforge.engine.health import GradHealth
from vlforge.engine.losses import count_supervised, sft_loss_sum
from vlforge.engine.metrics import MetricsLog, plot_metric, read_metrics
from vlforge.engine.optim import build_optimizer, build_scheduler
from vlforge.engine.precision import PrecisionPolicy
from vlforge.engine.runtime import prepare_output_dir, resolve_device, seed_everything
from vlforge.model.load import load_model
from vlforge.model.quant import format_report, keep_trainable, verify
from vlforge.model.tiers import apply_plan, build_plan, param_groups, plan_summary, unwrap
from vlforge.recipes.eval import EvalRecorder, to_device


@dataclass
class Trainable:
    """A model ready to train: the (possibly peft-wrapped) model, its processor, plan and policy."""

    model: torch.nn.Module
    processor: object
    plan: list
    policy: PrecisionPolicy
    device: torch.device
    fp8_plan: dict = field(default_factory=dict)  # linear name -> fp8.Decision (empty without FP8)

    @property
    def token_multiple(self) -> int:
        """Pad batches to this many tokens per row: FP8 GEMMs want dims that are multiples of 16."""
        return 16 if any(d.convert for d in self.fp8_plan.values()) else 1


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile each language-model decoder layer in place (parameter names unchanged)."""
    layers = unwrap(model).model.language_model.layers
    for layer in layers:
        layer.compile()
    return len(layers)


def setup_model(cfg: SFTConfig, auto_compile: bool = True) -> Trainable:
    """Load, plan, wrap and cast the model. `auto_compile=False` keeps precision.compile=auto off
    (GRPO: rollout decode shapes change every step, which compiled blocks would keep recompiling)."""
    device = resolve_device(cfg.train.device)
    policy = PrecisionPolicy(cfg.precision, device.type)
    if problem := bf16_problem(device) if cfg.precision.mode == "bf16" else None:
        raise ConfigError(problem)
    if cfg.quant.enabled and cfg.tiers.method != "lora":
        raise ConfigError("quant (QLoRA) needs tiers.method=lora: quantized base weights cannot be trained directly")
    if cfg.precision.fp8.enabled and cfg.quant.enabled:
        raise ConfigError("precision.fp8 and quant cannot be combined: FP8 training converts plain bf16 linears, "
                          "a quantized base has none; use QLoRA (quant) or FP8, not both")
    if cfg.precision.fp8.enabled and cfg.precision.fp8.backend == "te" and cfg.precision.gradient_checkpointing:
        raise ConfigError("precision.fp8.backend=te with gradient_checkpointing: the recomputation runs outside "
                          "te.autocast; use the torchao backend or turn checkpointing off")
    fp8 = fp8_backend(cfg.precision.fp8, device) if cfg.precision.fp8.enabled else None  # fails before loading
    # Full fine-tuning loads straight into the master dtype; LoRA loads the frozen base in the
    # compute dtype (peft creates the adapters in fp32). policy.apply then settles every tensor.
    load_dtype = policy.master_dtype if cfg.tiers.method == "full" else policy.compute_dtype
    # QLoRA: no peft prepare_model_for_kbit_training here, it would upcast every non-quantized
    # weight (the whole vision tower) to fp32; policy.apply below leaves the packed 4-bit weights
    # alone and keeps the rest in their storage dtypes, and non-reentrant checkpointing needs no
    # input that requires grad.
    model, processor = load_model(cfg.model, dtype=load_dtype, device=device, quant=cfg.quant)
    if cfg.quant.enabled:
        print(format_report(verify(model, cfg.quant)))
        keep_trainable(model)  # evals and rollouts switch to eval mode mid-run
    plan = build_plan(model, cfg.tiers)
    model = apply_plan(model, plan)
    fp8_plan = {}
    if fp8 is not None:
        fp8_plan = fp8_layer_plan(unwrap(model), cfg.precision.fp8)
        fp8.convert(unwrap(model), fp8_plan)
    policy.apply(model)
    if cfg.precision.gradient_checkpointing:
        core = unwrap(model)
        if hasattr(core, "activation_checkpointing_enable"):  # the name in transformers >= 5.2x
            core.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            core.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_on = cfg.precision.compile is True or (
        auto_compile and cfg.precision.compile == "auto" and fp8 is not None and cfg.precision.fp8.backend == "torchao")
    if compile_on:
        compile_blocks(model)
    model.train()
    return Trainable(model, processor, plan, policy, device, fp8_plan)


def micro_batches(data: SFTDataset, batch_size: int, seed: int, epoch: int, position: int, num_workers: int,
                  token_multiple: int = 1):
    """Endless stream of (batch, epoch, position-after) continuing across epochs; resumable."""
    while True:
        index_lists = list(batches_from(len(data), batch_size, seed, epoch, position))
        if not index_lists:
            if position == 0:
                raise ConfigError(f"train.batch_size={batch_size} is larger than the dataset ({len(data)} samples)")
            epoch, position = epoch + 1, 0
            continue
        # The loader gets its own generator: creating an iterator draws a seed from it, and drawing
        # from the global RNG instead would shift dropout masks after a mid-epoch resume.
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=[ix for ix, _ in index_lists], num_workers=num_workers,
            # a partial, not a lambda: picklable for worker processes
            collate_fn=functools.partial(collate, pad_id=data.encoder.pad_id, multiple=token_multiple),
            generator=torch.Generator().manual_seed(seed + epoch))
        for batch, (_, pos) in zip(loader, index_lists):
            yield batch, epoch, pos
        epoch, position = epoch + 1, 0


def train_step(t: Trainable, micro: list[dict], optimizer, scaler, health: GradHealth,
               max_grad_norm: float | None) -> dict:
    """One optimizer step over the accumulated micro-batches. Returns step metrics."""
    # data.on_error=skip: rows whose image failed to decode are left out of their batch (counted)
    skipped_rows = sum(int(b.get("skipped_rows", 0)) for b in micro)
    skipped = {"skipped_rows": skipped_rows} if skipped_rows else {}
    micro = [b for b in micro if len(b["input_ids"])]
    total_tokens = sum(count_supervised(b) for b in micro)
    if total_tokens == 0:  # every row of the step was skipped: no update (and no 0/0 loss)
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float("nan"), "grad_norm": 0.0, "skipped": True, **skipped, "supervised_tokens": 0,
                "tokens": sum(int(b["attention_mask"].sum()) for b in micro)}
    loss_total = 0.0
    for batch in micro:
        batch = to_device(batch, t.device)
        with t.policy.autocast():
            loss_sum, _ = sft_loss_sum(t.model, batch)  # fp32 whatever the compute dtype
        loss = loss_sum / total_tokens
        scaler.scale(loss).backward()
        loss_total += float(loss.detach())
    row = health.step(optimizer, scaler, max_grad_norm, loss_total)
    return {"loss": loss_total, **row, **skipped, "supervised_tokens": total_tokens,
            "tokens": sum(int(b["attention_mask"].sum()) for b in micro)}


def run_sft(cfg: SFTConfig) -> dict:
    """Train; returns {"output_dir", "final_step", "eval"}."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is the progress display; no per-save shard bars
    resume_from = prepare_output_dir(cfg.train.output_dir, cfg.train.resume, cfg.train.overwrite)
    out = Path(cfg.train.output_dir)
    if not cfg.data.train:
        raise ConfigError("data.train is not set: give a JSONL file (data.train=path/to/train.jsonl)")
    seed_everything(cfg.train.seed)
    t = setup_model(cfg)
    train_data = load_dataset(cfg.data.train, t.processor, cfg.data)
    val_data = load_dataset(cfg.data.val, t.processor, cfg.data) if cfg.data.val else None
    (out / "config.yaml").write_text(dump_config(cfg))  # only once the run can start
    summary = plan_summary(unwrap(t.model), t.plan)

    tc = cfg.train
    samples_per_step = tc.batch_size * tc.grad_accum
    steps_per_epoch = len(train_data) // samples_per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"batch_size x grad_accum = {samples_per_step} exceeds the {len(train_data)} training samples")
    total_steps = tc.max_steps or tc.epochs * steps_per_epoch
    optimizer = build_optimizer(param_groups(t.model, t.plan, cfg.optim.weight_decay), cfg.optim, t.device.type)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps)
    scaler = t.policy.grad_scaler()
    health = GradHealth(t.model, t.plan, cfg.health, cfg.precision.mode)

    state = {"epoch": 0, "position": 0, "tokens_seen": 0}
    if resume_from is not None:
        state = load_checkpoint(resume_from, t.model, optimizer, scheduler, scaler)
        print(f"resumed from {resume_from} at step {state['step']}")
    step = state.get("step", 0)
    metrics = MetricsLog(out, cfg.log.tensorboard, resume_step=step if resume_from else 0)
    recorder = EvalRecorder(out, val_data, cfg.eval, metrics, step) if val_data is not None else None

    def run_eval(at_step: int) -> dict:
        return recorder(t.model, at_step, t.policy, t.device)

    print(f"training {summary['trainable_params']:,} of {summary['total_params']:,} parameters "
          f"({cfg.tiers.method}); {len(train_data)} samples, {total_steps} steps, device {t.device}")
    if train_data.report.skipped:
        print(f"skipped rows: {dict(train_data.report.skipped)}")
    if val_data is not None and cfg.eval.at_start and step == 0:
        run_eval(0)

    stream = micro_batches(train_data, tc.batch_size, tc.seed, state["epoch"], state["position"], cfg.data.num_workers,
                           t.token_multiple)
    bar = tqdm(total=total_steps, initial=step, disable=not cfg.log.progress, desc="sft", dynamic_ncols=True)
    last_eval = None
    while step < total_steps:
        start = time.perf_counter()
        micro = []
        for _ in range(tc.grad_accum):
            batch, state["epoch"], state["position"] = next(stream)
            micro.append(batch)
        lr = scheduler.get_last_lr()[0]
        result = train_step(t, micro, optimizer, scaler, health, cfg.optim.max_grad_norm)
        scheduler.step()
        step += 1
        elapsed = time.perf_counter() - start
        state["tokens_seen"] += result["tokens"]
        row = {**{k: v for k, v in result.items() if k not in ("tokens", "supervised_tokens")}, "lr": lr,
               "tokens_per_s": result["tokens"] / elapsed, "epoch": state["epoch"]}
        if step % cfg.log.every == 0 or step == total_steps or row["skipped"] or "loss_spike" in row:
            metrics.log(step, row)  # skipped steps and spikes are always logged, whatever log.every says
        bar.update(1)
        bar.set_postfix(loss=f"{result['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}")
        if val_data is not None and ((cfg.eval.every and step % cfg.eval.every == 0) or step == total_steps):
            last_eval = run_eval(step)
        if (tc.save_every and step % tc.save_every == 0) or step == total_steps:
            save_checkpoint(out, step, t.model, t.processor, optimizer, scheduler, scaler, state, tc.keep_last)
    bar.close()
    metrics.close()
    rows = read_metrics(out / "metrics.jsonl")
    marks = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    # log scale: losses span orders of magnitude and a linear axis hides the tail
    plot_metric(rows, "loss", out / "loss.png", title="training loss", marks=marks, log_y=True)
    return {"output_dir": str(out), "final_step": step, "eval": last_eval, "plan": summary}

