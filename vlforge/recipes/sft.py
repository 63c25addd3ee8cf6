"""Supervised fine-tuning of Qwen3-VL: LoRA tiers or full, one readable step loop.

    vlforge sft configs/demo-sft.yaml
    vlforge sft configs/qwen3vl-8b-lora.yaml model.path=/weights/Qwen3-VL-8B-Instruct data.train=train.jsonl

Per optimizer step: `grad_accum` micro-batches, each loss a *sum* of token cross-entropies divided
by the number of supervised tokens in the whole accumulated batch, so the update is the same for
batch 8 x accum 1 and batch 2 x accum 4. Then unscale (fp16 only), clip, step, schedule.
A micro-batch is train.batch_size samples or, with data.max_tokens_per_batch, as many as fit that
many tokens; padded rows, or (data.packing) one row of samples back to back (docs/packing.md).
"""

from __future__ import annotations

import functools
import time

import torch
from tqdm import tqdm

from vlforge.config import ConfigError, LossConfig, SFTConfig, TrainConfig
from vlforge.data.dataset import Batching, ChatDataset, global_batches, load_dataset, micro_batches_per_epoch
from vlforge.data.encode import collate, pack
from vlforge.data.inline import DataError
from vlforge.data.sources import check_readable
from vlforge.train.sharding import no_sync
from vlforge.train.health import GradHealth
from vlforge.train.inputs import HostPrep, count_supervised, count_tokens, real_tokens, step_inputs
from vlforge.train.losses import sft_loss_sum
from vlforge.train.sharding import drop_keepalive_grads
from vlforge.train.metrics import plot_metric, read_metrics
from vlforge.train.moe import aux_term, capture
from vlforge.train.optim import hold_gradients
from vlforge.train.packed_attention import packing_pays
from vlforge.train.recompute import decide_recompute, longest_micro_batch, redo_on_oom
from vlforge.train.run import Run, begin_run
from vlforge.train.runtime import resolve_device, resolve_num_workers
from vlforge.train.stop import StopSignals, ignore_stop_signals
from vlforge.train.throughput import StepMeter
from vlforge.train.trainable import Trainable, cuda_graph_step_begin, cuda_graphs_problem, setup_model
from vlforge.model.tiers import plan_summary, unwrap


def _join_and_prepare(join, prepare, samples: list[dict]) -> dict:
    return prepare(join(samples))


def micro_batches(data: ChatDataset, batch_size: int | Batching, seed: int, epoch: int, position: int,
                  num_workers: int, token_multiple: int = 1, rank: int = 0, world_size: int = 1,
                  pad_to: int | None = None, prepare: HostPrep | None = None, pin_memory: bool = False):
    """Endless stream of (batch, epoch, position-after) continuing across epochs; resumable.

    `batch_size`: samples per micro-batch, or a Batching (token budget, packed rows). With several
    ranks, each global micro-batch (the micro-batches one process would take in turn, one per
    rank) is split so that rank r takes the r-th part (data.dataset.global_batches); epoch and
    position count global samples, so a run resumes on any number of ranks. `pad_to`: packed
    rows' fixed length (flex_attention). `prepare` (HostPrep.of(model)): what the step reads on
    the host, computed in the loader's workers at collate time; `pin_memory`: the loader pins
    each batch (its own thread), so the step's copies to the GPU are non-blocking without a
    memcpy on the main thread."""
    batching = batch_size if isinstance(batch_size, Batching) else Batching(batch_size)
    lengths = data.lengths
    if batching.packed:  # a partial, not a lambda: picklable for worker processes
        collate_fn = functools.partial(pack, pad_id=data.encoder.pad_id, multiple=token_multiple, pad_to=pad_to)
    else:
        collate_fn = functools.partial(collate, pad_id=data.encoder.pad_id, multiple=token_multiple)
    if prepare is not None:
        collate_fn = functools.partial(_join_and_prepare, collate_fn, prepare)
    while True:
        global_lists = list(global_batches(lengths, batching, seed, epoch, position, world_size))
        if not global_lists:
            if position == 0:
                what = (f"data.max_tokens_per_batch={batching.max_tokens} gives fewer batches than the {world_size} "
                        "processes" if batching.max_tokens else f"train.batch_size={batching.batch_size} x "
                        f"{world_size} processes is larger than the dataset")
                raise ConfigError(f"{what} ({len(data)} samples)")
            epoch, position = epoch + 1, 0
            continue
        index_lists = [(ix[rank], pos) for ix, pos in global_lists]
        # The loader gets its own generator: creating an iterator draws a seed from it, and drawing
        # from the global RNG instead would shift dropout masks after a mid-epoch resume.
        # Its workers ignore SIGINT/SIGTERM: a step finishing after a stop signal still reads its batches
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=[ix for ix, _ in index_lists], num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed + epoch),
            worker_init_fn=ignore_stop_signals)
        for batch, (_, pos) in zip(loader, index_lists):
            yield batch, epoch, pos
        epoch, position = epoch + 1, 0


def train_step(t: Trainable, micro: list[dict], optimizer, scaler, health: GradHealth,
               max_grad_norm: float | None, loss: LossConfig = LossConfig(), stop: StopSignals | None = None) -> dict:
    """One optimizer step over the accumulated micro-batches (padded or packed). Returns step metrics.
    `stop`: its ranks' stop votes ride on the step's first all-reduce (train/stop.py)."""
    # data.on_error=skip: rows whose image failed to decode are left out of their batch (counted)
    skipped_rows = sum(int(b.get("skipped_rows", 0)) for b in micro)
    skipped = {"skipped_rows": skipped_rows} if skipped_rows else {}
    world = t.world
    kept = [b for b in micro if len(b["input_ids"])]
    if world.wrapped and len(kept) < len(micro):  # the other ranks would wait for its forward (backward)
        raise DataError("every row of one micro-batch was skipped (data.on_error=skip) in a distributed run, where "
                        "each rank must run every micro-batch: fix or drop the rows `vlforge data check` reports")
    micro = kept
    # the supervised tokens of the whole global batch (every micro-batch on every rank), and the stop votes
    total_tokens, *votes = world.sums(sum(count_supervised(b) for b in micro), *(stop.vote() if stop else ()))
    total_tokens = int(total_tokens)
    if stop:
        stop.tally(*votes)
    if total_tokens == 0:  # every row of the step was skipped: no update (and no 0/0 loss)
        optimizer.zero_grad(set_to_none=True)
        return {"loss": float("nan"), "grad_norm": 0.0, "skipped": True, **skipped, "supervised_tokens": 0,
                "tokens": sum(count_tokens(b) for b in micro)}
    loss_total = None  # fp64 on the device, read once after the last backward (a read per micro-batch is a sync)
    for i, batch in enumerate(micro):
        warning = cuda_graph_step_begin(t, micro, i)  # CUDA graphs: a new generation (else nothing)
        if warning and world.main:
            print(warning)
        # positions, counts and label indices from the CPU copy, then the batch to the device (no sync).
        # The recipe's loader computed them in its workers (HostPrep, pinned by its pin_memory), so here
        # only copies are queued. Workers rather than a one-ahead pipeline here (micro-batch i+1's host
        # work after launching i's backward): that would hide nothing for a step's first micro-batch,
        # where the GPU is idle after the previous step's loss read, so nothing with grad_accum=1; the
        # workers' prefetch overlaps every micro-batch, the first included, with the steps before it.
        batch = step_inputs(t.model, batch, t.device)
        with t.policy.autocast(), capture(t.routing, real_tokens(batch)) as routed:  # MoE: router logits
            # fp32 whatever the compute dtype; distributed, through the FSDP2 root unit or DDP (which also
            # runs the vision tower on a text-only micro-batch: the other ranks' collectives wait for it)
            with no_sync(t.root, last=i == len(micro) - 1):  # DDP: one gradient all-reduce per step
                loss_sum, _ = t.forward(sft_loss_sum, batch, keep_vision=world.wrapped, loss=loss)
        micro_loss = loss_sum / total_tokens
        # FSDP2 and DDP average gradients over ranks; x world size makes it the global batch's sum. MoE: +
        # the router load-balancing loss, the mean over every rank's micro-batches (the ranks' average
        # makes it so: no x world size), logged apart as moe/aux_loss
        with no_sync(t.root, last=i == len(micro) - 1):
            scaler.scale(micro_loss * world.size + aux_term(t.routing, routed, len(micro))).backward()
        if i < len(micro) - 1:
            hold_gradients(optimizer)  # master_weights=optimizer: bf16 gradients summed in fp32
        micro_loss = micro_loss.detach().double()  # fp64, as the host's float sum it replaces: the same bits
        loss_total = micro_loss if loss_total is None else loss_total + micro_loss
    # the global batch's loss (the same on every rank), its micro-batches with images, its tokens
    loss_total, with_images, tokens = world.sums(loss_total.item(),
                                                 sum(b.get("pixel_values") is not None for b in micro),
                                                 sum(count_tokens(b) for b in micro))
    if world.wrapped and not with_images:
        drop_keepalive_grads(t.model)
    row = health.step(optimizer, scaler, max_grad_norm, loss_total)
    moe = t.routing.step_metrics(world) if t.routing else {}  # expert load of the step's tokens
    return {"loss": loss_total, **row, **moe, **skipped, "supervised_tokens": total_tokens, "tokens": int(tokens)}


def check_resumed_packing(state: dict, packed: bool, batching: Batching, say=print) -> None:
    """Record whether this run packs (data.packing=auto decides by the device) in the run's state; a
    resumed run that decides otherwise than its checkpoint's: refused with a token budget (the
    budget forms other micro-batches, so the data order and the step count would not continue),
    else a note (the same samples a micro-batch, the same loss to rounding)."""
    saved = state.setdefault("packed", packed)  # a checkpoint from before it was recorded: taken as this run's
    if saved == packed:
        return
    was, now = ("packed", "padded") if saved else ("padded", "packed")
    if batching.max_tokens:
        raise ConfigError(f"the checkpoint's run {was} its rows and this one would have {now} them (data.packing="
                          f"auto decides by the device): with data.max_tokens_per_batch the micro-batches differ; "
                          f"set data.packing={str(saved).lower()} to resume it exactly")
    say(f"note: the checkpoint's run {was} its rows, this one has {now} them (data.packing=auto decides by the "
          "device): the same samples a micro-batch, the same loss to rounding")
    state["packed"] = packed


def count_steps(train_data: ChatDataset, batching: Batching, tc: TrainConfig, world_size: int) -> int:
    """The run's optimizer steps: train.max_steps, else the epochs' global micro-batches / grad_accum."""
    per_epoch = [micro_batches_per_epoch(train_data.lengths, batching, tc.seed, e, world_size)
                 for e in range(1 if tc.max_steps else tc.epochs)]  # global micro-batches
    if per_epoch[0] < tc.grad_accum:
        what = (f"data.max_tokens_per_batch={batching.max_tokens} makes {per_epoch[0]} micro-batches per "
                f"process" if batching.max_tokens else f"batch_size x processes = {tc.batch_size * world_size} "
                f"makes {per_epoch[0]} micro-batches")
        raise ConfigError(f"{what} of the {len(train_data)} training samples, fewer than "
                          f"train.grad_accum={tc.grad_accum}")
    return tc.max_steps or sum(n // tc.grad_accum for n in per_epoch)


def run_sft(cfg: SFTConfig) -> dict:
    """Train; returns {"output_dir", "final_step", "eval", "plan"}."""
    if not cfg.data.train:
        raise ConfigError("data.train is not set: give a JSONL file (data.train=path/to/train.jsonl)")
    for path in filter(None, (cfg.data.train, cfg.data.val)):  # a bad file fails now, not after the model loads
        check_readable(path, cfg.data.on_error, cfg=cfg.data)
    # before the run begins (its directory, the model): what can be told from the config and the device
    if cfg.compile.cuda_graphs and (problem := cuda_graphs_problem(cfg, resolve_device(cfg.train.device))):
        raise ConfigError(problem)
    # SIGINT/SIGTERM (train/stop.py): once training runs, the step in progress finishes, then a checkpoint
    with StopSignals() as stop, begin_run(cfg) as (world, resume_from):
        t = setup_model(cfg, world=world, resume_from=resume_from)
        train_data = load_dataset(cfg.data.train, t.processor, cfg.data)
        val_data = load_dataset(cfg.data.val, t.processor, cfg.data) if cfg.data.val else None
        tc = cfg.train
        # rows padded for FP8 count against the token budget as padded (the tokens the step computes)
        packed = (packing_pays(unwrap(t.model), t.device, cfg.precision.mode) if cfg.data.packing == "auto"
                  else cfg.data.packing)
        batching = Batching.of(cfg.data, tc.batch_size, t.token_multiple, packed)
        total_steps = count_steps(train_data, batching, tc, world.size)
        say = print if world.main else (lambda *a, **k: None)  # one process speaks for the run
        # activation_checkpointing (auto: from the memory of the data's longest micro-batch), before config.yaml
        lengths = [cfg.data.max_length] * tc.batch_size if cfg.data.stream else train_data.lengths  # streamed: unread
        decide_recompute(cfg, t, longest_micro_batch(lengths, tc.batch_size, batching.packed, batching.max_tokens), say)
        run = Run.start(cfg, t, total_steps, val_data, resume_from, spikes=True, state={"tokens_seen": 0})
        check_resumed_packing(run.state, packed, batching, say)
        summary = plan_summary(unwrap(t.model), t.plan)
        say(f"training {summary['trainable_params']:,} of {summary['total_params']:,} parameters "
              f"({cfg.tiers.method}); {len(train_data)} samples, {total_steps} steps, device {t.device}"
            + (f", {world.size} processes ({world.strategy})" if world.strategy != "none" else "")
            + (f"; compiled: {' and '.join(t.compiled)}" if t.compiled else "")
            + ("; packed rows (data.packing)" if packed else ""))
        if train_data.report.skipped:
            say(f"skipped rows: {dict(train_data.report.skipped)}")
        meter = StepMeter(unwrap(t.model), t.device)
        if why := meter.why_no_mfu():
            say(why)
        if cfg.eval.at_start and run.step == 0:
            run.evaluate()

        # flex_attention compiles for each new shape: packed rows of one fixed length (the budget) then
        pad_to = batching.packed_length if cfg.model.attention.implementation == "flex_attention" else None
        # the step's host inputs made with the batches (in the workers, with data.num_workers > 0)
        stream = micro_batches(train_data, batching, tc.seed, run.state["epoch"], run.state["position"],
                               resolve_num_workers(cfg.data.num_workers, t.device), batching.multiple,
                               world.rank, world.size, pad_to, prepare=HostPrep.of(t.model),
                               pin_memory=t.device.type == "cuda")
        bar = tqdm(total=total_steps, initial=run.step, disable=not (cfg.log.progress and world.main), desc="sft",
                   dynamic_ncols=True)
        stop.watch(run)
        while run.step < total_steps:
            start = time.perf_counter()
            micro = []
            for _ in range(tc.grad_accum):
                batch, run.state["epoch"], run.state["position"] = next(stream)
                micro.append(batch)
            lr = run.lr
            # out of memory under activation_checkpointing=auto: the same micro-batches again, one notch further
            result = redo_on_oom(lambda: train_step(t, micro, run.optimizer, run.scaler, run.health,
                                                    cfg.optim.max_grad_norm, cfg.loss, stop), t, run.optimizer, say)
            elapsed = time.perf_counter() - start
            run.state["tokens_seen"] += result["tokens"]
            row = {**{k: v for k, v in result.items() if k not in ("tokens", "supervised_tokens")}, "lr": lr,
                   **meter.row(micro, result["tokens"], elapsed), "epoch": run.state["epoch"]}
            run.finish_step(row, always_log=row["skipped"] or "loss_spike" in row)  # bad steps always logged
            bar.update(1)
            bar.set_postfix(loss=f"{result['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{row['tokens_per_s']:.0f}",
                            mem=f"{row.get('mem/peak_allocated_gb', row.get('mem/peak_rss_gb', 0)):.1f}GB")
            if stop.agreed():  # every rank: the votes this step's first all-reduce carried
                break
        stream.close()  # its DataLoader's workers end now (they ignore SIGTERM: see micro_batches)
        stop.checkpoint()
        bar.close()
        run.close()
        if world.main:
            rows = read_metrics(run.out / "metrics.jsonl")
            marks = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
            # log scale: losses span orders of magnitude and a linear axis hides the tail
            plot_metric(rows, "loss", run.out / "loss.png", title="training loss", marks=marks, log_y=True)
        return {"output_dir": str(run.out), "final_step": run.step, "eval": run.last_eval, "plan": summary}
