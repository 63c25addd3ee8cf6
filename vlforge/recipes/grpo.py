"""GRPO with verifiable rewards for Qwen3-VL: one readable step loop.

    vlforge grpo configs/demo-grpo.yaml
    vlforge grpo configs/qwen3vl-8b-grpo.yaml model.path=/weights/Qwen3-VL-8B-Instruct data.train=prompts.jsonl

Per step: B prompts x G sampled responses (each prompt's image encoded once, its prefill shared)
-> rewards -> group-normalised advantages -> `rl.epochs` passes of mini-batch updates with the
clipped policy loss on the rollout's log-probs (+ beta * KL to the reference on response tokens).
With LoRA the reference is the same model with adapters disabled; with full fine-tuning, a frozen copy.
With tools.names each response is a conversation: its tool calls run between turns and their
results are read but not trained (rollout/multiturn.py; the loss masks are Rollout.loss_mask).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import time

import torch
from tqdm import tqdm

from vlforge.config import ConfigError, GRPOConfig
from vlforge.data.dataset import ChatDataset, batches_from, load_dataset
from vlforge.data.encode import collate, encode_engine_prompt, visuals_per_prompt
from vlforge.data.inline import DataError
from vlforge.data.sources import check_readable
from vlforge.train.distributed import World, planned_strategy, torchrun_env
from vlforge.train.evaluate import to_device
from vlforge.train.health import GradHealth
from vlforge.train.sharding import drop_keepalive_grads, frozen_sharded_copy, fully_gathered, no_sync
from vlforge.train.metrics import plot_metric, read_metrics
from vlforge.train.moe import aux_term, capture, follow
from vlforge.train.optim import hold_gradients
from vlforge.train.run import Run, begin_run
from vlforge.train.stop import StopSignals
from vlforge.train.recompute import decide_recompute, redo_on_oom
from vlforge.train.throughput import peak_memory
from vlforge.train.trainable import Trainable, cuda_graphs_problem, setup_model
from vlforge.generate.engine import Engine
from vlforge.generate.fp8 import fp8_gemm_problem
from vlforge.model.load import build_meta_model, dir_config
from vlforge.model.presets import MOE_PRESETS, is_moe
from vlforge.rl import RewardSpec, agg_loss, build_rewards, exact_match, kl_penalty, outcome_advantages, policy_loss
from vlforge.tools.registry import Tool
from vlforge.tools.runner import run_tool_calls
from vlforge.rollout.groups import Rollout, generate_groups, rollout_seed
from vlforge.rollout.logprobs import packing_enabled, route_rows, sequence_logprobs
from vlforge.rollout.minibatch import (Batch, correct_rollouts, logprobs_before_update, part_weights, rank_mini_batches,
                                       token_rows)
from vlforge.rollout.multiturn import answer_with_tools, generate_with_tools, rollout_tools, tool_images, tool_runner
from vlforge.rollout.metrics import judge_metrics, step_metrics
from vlforge.rollout.precision import refresh_rollout_weights, rollout_precision
from vlforge.infer.model import InferenceModel
from vlforge.rl.judge import ModelJudge


def disable_dropout(model) -> None:
    """GRPO's importance ratio must be exactly 1 on-policy: no dropout when recomputing log-probs
    (verl does the same). Qwen3-VL itself has none; this turns off the LoRA tiers' dropout."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def prompt_stream(data: ChatDataset, batch_size: int, seed: int, epoch: int, position: int, world: World = World()):
    """Endless (indices, epoch, position-after) over the prompt set, resumable like SFT's. With
    several ranks each global batch of `batch_size` prompts is split into contiguous slices, rank r
    taking the r-th: every group stays whole on one rank."""
    per_rank = batch_size // world.size
    while True:
        for idx, pos in batches_from(data.lengths, batch_size, seed, epoch, position):
            yield idx[world.rank * per_rank:(world.rank + 1) * per_rank], epoch, pos
        epoch, position = epoch + 1, 0


def encode_prompts(data: ChatDataset, idx: list[int], on_error: str,
                   tools: dict[str, Tool] | None = None) -> tuple[list, list[dict]]:
    """(samples, prompt inputs) of these prompts, `tools` (tools.names) listed by the chat template;
    with data.on_error=skip, a prompt whose image fails to decode is left out of the round (a warning
    names its file:line)."""
    schemas = [tool.schema for tool in tools.values()] if tools else []  # only the tools the rollout runs
    samples, prompts = [], []
    for i in idx:
        try:
            prompts.append(encode_engine_prompt(data.encoder, data.samples[i], tools=schemas))
            samples.append(data.samples[i])
        except DataError as e:
            if on_error == "fail":
                raise
            tqdm.write(f"warning: skipping a prompt (data.on_error=skip): {e}", file=sys.stderr)
    return samples, prompts


def rollout_round(t: Trainable, data: ChatDataset, idx: list[int], cfg: GRPOConfig,
                  rewards, tools: dict[str, Tool] | None = None,
                  run_calls=run_tool_calls, engine: Engine | None = None) -> tuple[Rollout | None, dict]:
    samples, encoded = encode_prompts(data, idx, cfg.data.on_error, tools)
    engine = engine if engine is not None else Engine(t.model)  # the run's (run_grpo's), or one for this round
    G = cfg.rollout.group_size
    # every rank's prompts left after data.on_error=skip: this rank's rows of the global batch are
    # the ones one process would give these prompts (its rollout noise, tested)
    counts = t.world.gather_objects(len(samples))
    first_row = sum(counts[:t.world.rank]) * G
    seed = rollout_seed()  # drawn on every rank, also one with no prompt left: the RNG streams stay in step
    if not samples:
        with fully_gathered(t.root):  # sharded: gathered with the ranks that do roll out
            pass
        return None, {}
    prompts = to_device(collate(encoded, data.encoder.pad_id, left_pad=True), t.device)
    # sharded: the whole model gathered for the rollout, so that ranks decoding for different
    # numbers of steps issue no collectives
    # (fp32 masters: the linears' weights read in bf16 during the rollout, PrecisionPolicy.inference_weights)
    images = [visuals_per_prompt(x) for x in encoded]  # a video's temporal patches count as its images
    tool_stats = tool_fields = transcripts = None
    # rollout.precision=fp8: the decoder projections on FP8 copies (rollout/precision.py)
    with t.policy.autocast(), t.policy.inference_weights(t.model), rollout_precision(engine, cfg.rollout), \
            fully_gathered(t.root):
        if tools:  # multi-turn: the rewards score each response's last assistant turn
            multi = generate_with_tools(engine, data.encoder, prompts, images, cfg.rollout, tools,
                                        first_row=first_row, seed=seed, run_calls=run_calls,
                                        prompt_images=tool_images(samples, tools, data.encoder), settings=cfg.tools)
            rollout, texts = multi.rollout, multi.completions
            tool_stats = {"calls": multi.calls, "failed_calls": multi.failed_calls, "turns": multi.turns,
                          "unshown": multi.unshown}
            tool_fields, transcripts = multi.reward_fields, multi.transcripts
        else:
            rollout = generate_groups(engine, data.encoder, prompts, images, cfg.rollout,
                                      first_row=first_row, seed=seed)
            tok = data.encoder.tokenizer  # decode only each response's own tokens (not the padding after EOS)
            texts = [tok.decode(ids[m.bool()], skip_special_tokens=True)
                     for ids, m in zip(rollout.response_ids.cpu(), rollout.response_mask.cpu())]
    answers = [s.answer for s in samples for _ in range(G)]
    fields = [s.fields for s in samples for _ in range(G)]
    if tool_fields is not None:  # what the response did with the tools, for rewards that shape tool use
        fields = tool_fields(fields)
    scored = rewards(texts, answers, fields, prompts=[s.prompt_messages for s in samples for _ in range(G)])
    reward_N = torch.tensor(scored.total, dtype=torch.float32)
    reward_N -= cfg.rl.overlong_penalty * (~rollout.finished).float().cpu()
    return rollout, {"reward": reward_N, "per_fn": scored.per_fn,
                     "correct": [exact_match(c, a) for c, a in zip(texts, answers)], "tools": tool_stats,
                     # what the sample log shows (train/samples.py): this rank's groups as they were
                     "rollout": rollout, "texts": texts, "samples": samples, "transcripts": transcripts}


def collect(t: Trainable, data, stream, state: dict, cfg: GRPOConfig, rewards, tools: dict[str, Tool] | None = None,
            run_calls=run_tool_calls, engine: Engine | None = None) -> tuple[list[Batch], dict, Batch | None]:
    """Rollout rounds until B groups with non-zero reward variance (dynamic sampling) or one round.
    Returns (this rank's kept groups, every rank's statistics, a spare sequence of this rank's for
    padding updates, or None).

    Several ranks: each round's rewards are gathered, so the kept groups are the ones one process
    would keep (the first B with reward variance, in prompt order) with its advantages; each rank
    trains those of its own prompts, so the ranks' shares may differ (update pads them)."""
    B, G, world = cfg.rollout.prompts_per_step, cfg.rollout.group_size, t.world
    batches, stats = [], {"reward": [], "correct": [], "per_fn": {}, "zero_var": [], "lengths": [], "finished": [],
                          "tools": {"calls": [], "failed_calls": [], "turns": [], "unshown": []}}
    # kept_rewards / kept_lengths: each round's kept sequences' rewards and response lengths, every rank's
    kept_groups, kept_rewards, kept_lengths, spare = 0, [], [], None
    for _ in range(cfg.rl.max_sampling_tries if cfg.rl.dynamic_sampling else 1):
        idx, state["epoch"], state["position"] = next(stream)
        rollout, scored = rollout_round(t, data, idx, cfg, rewards, tools, run_calls, engine)
        if rollout is not None:
            stats.setdefault("shown", scored)  # the step's first round on this rank: the sample log's groups
        scored, sizes = gather_round(world, rollout, scored)  # the global batch, in one-process order
        if scored is None:  # every prompt of the round was skipped (data.on_error=skip), on every rank
            continue
        if rollout is not None:
            spare = Batch(rollout, [0], torch.zeros(len(rollout.finished), device=t.device), None)
        lo = sum(sizes[:world.rank])  # this rank's sequences are lo .. lo + sizes[rank] of the round's
        reward_BG = scored["reward"].view(-1, G)  # fewer than B rows when prompts were skipped
        zero_var = (reward_BG.max(1).values == reward_BG.min(1).values)
        stats["reward"].append(scored["reward"])
        stats["correct"] += scored["correct"]
        stats["zero_var"].append(zero_var.float())
        stats["lengths"].append(scored["lengths"])
        stats["finished"].append(scored["finished"])
        for k, v in scored["per_fn"].items():
            stats["per_fn"].setdefault(k, []).extend(v)
        for k, v in (scored["tools"] or {}).items():
            stats["tools"][k].extend(v)
        groups = [b for b in range(len(reward_BG)) if not (cfg.rl.dynamic_sampling and zero_var[b])][:B - kept_groups]
        kept = [b * G + g for b in groups for g in range(G)]  # the round's kept sequences, all ranks'
        mine = [(row, s - lo) for row, s in enumerate(kept) if lo <= s < lo + sizes[world.rank]]
        if mine:
            adv = outcome_advantages(scored["reward"], G, cfg.rl.advantage, cfg.rl.adv_scale,
                                     lengths=scored["lengths"])[lo:lo + sizes[world.rank]]
            offset = sum(len(r) for r in kept_rewards)
            batches.append(Batch(rollout, [s for _, s in mine], adv.to(t.device), None,
                                 kept_rows=[offset + row for row, _ in mine]))
        if kept:
            kept_rewards.append(scored["reward"][kept])
            kept_lengths.append(scored["lengths"][kept])
        kept_groups += len(groups)
        if kept_groups >= B:
            break
    if not stats["reward"]:
        raise DataError(f"every prompt of this step's rollout rounds failed to decode (data.on_error=skip); "
                        f"run `vlforge data check {cfg.data.train}` and fix or drop those rows")
    if batch_statistics(cfg.rl) and kept_rewards:  # over the kept groups only, as verl filters first
        pool_batch_statistics(batches, kept_rewards, kept_lengths, G, cfg.rl)
    return batches, stats, spare


def gather_round(world: World, rollout: Rollout | None, scored: dict) -> tuple[dict | None, list[int]]:
    """A rollout round's rewards, per-function scores, correctness, lengths and finished flags
    from every rank, in rank order: the global batch, as one process would have scored it (None
    when every rank skipped all its prompts); and each rank's number of sequences."""
    mine = None if rollout is None else {
        "reward": scored["reward"], "per_fn": scored["per_fn"], "correct": scored["correct"],
        "lengths": rollout.loss_mask.sum(1).float().cpu(), "finished": rollout.finished.float().cpu(),
        "tools": scored.get("tools")}
    every = world.gather_objects(mine)  # one collective for all of it (ranks may hold different counts)
    sizes = [0 if p is None else len(p["reward"]) for p in every]
    every = [p for p in every if p is not None]
    if not every:
        return None, sizes
    return {"reward": torch.cat([p["reward"] for p in every]),
            "per_fn": {k: [v for p in every for v in p["per_fn"][k]] for k in every[0]["per_fn"]},
            "correct": [c for p in every for c in p["correct"]],
            "lengths": torch.cat([p["lengths"] for p in every]),
            "finished": torch.cat([p["finished"] for p in every]),
            "tools": None if every[0]["tools"] is None else {k: [v for p in every for v in p["tools"][k]]
                                                             for k in every[0]["tools"]}}, sizes


def batch_statistics(rl) -> bool:
    """Whether the advantages use statistics of the whole batch (not only of each group)."""
    return rl.advantage in ("reinforce++", "reinforce++-baseline") or (rl.advantage == "grpo"
                                                                       and rl.adv_scale == "batch")


def pool_batch_statistics(batches: list[Batch], kept_rewards: list[torch.Tensor], kept_lengths: list[torch.Tensor],
                          group_size: int, rl) -> None:
    """Advantages with batch statistics (batch_statistics) over the kept groups of every rollout
    round: one mean and std over what trains, not each round's (dropped groups left out).
    `kept_rewards` / `kept_lengths`: each round's kept rewards and response lengths (every rank's);
    a batch's kept_rows (or, without them, the batches in turn) say which are its own."""
    adv = outcome_advantages(torch.cat(kept_rewards), group_size, rl.advantage, rl.adv_scale,
                             lengths=torch.cat(kept_lengths))
    start = 0
    for b in batches:
        rows = b.kept_rows if b.kept_rows is not None else list(range(start, start + len(b.seqs)))
        start += len(b.seqs)
        b.advantages = b.advantages.clone()
        b.advantages[b.seqs] = adv[rows].to(b.advantages.device)


def update(t: Trainable, ref_model, batches: list[Batch], optimizer, scaler, health: GradHealth,
           cfg: GRPOConfig, spare: Batch | None = None) -> dict:
    """rl.epochs passes of mini-batch policy-gradient steps over the collected groups.

    A mini-batch may span rollout rounds (dynamic sampling): each part's loss is aggregated on its
    own and weighted by its share of the mini-batch's tokens (or sequences), which equals the loss
    of the concatenated mini-batch; one optimizer step per mini-batch. Several ranks: each takes
    its share of every mini-batch; `spare` pads the ranks with fewer (rollout/minibatch.py).
    """
    rl, world = cfg.rl, t.world
    packing = packing_enabled(t.model, rl.packing)  # the log-prob forwards on real tokens only (one row)
    replay = cfg.rollout.router_replay is True  # MoE: the rollout's experts in every forward (train/moe.py)
    recompute = rl.old_logprobs == "trainer"
    gap = logprobs_before_update(t, ref_model, batches, spare, cfg.rollout.temperature, rl.kl_beta > 0, recompute,
                                 packing, replay)
    c = rl.rollout_correction  # weights (and MIS's mask) from the trainer's old log-probs over the rollout's
    mismatch = correct_rollouts(batches, world, c.method, c.level, c.cap, tuple(c.band)) if recompute else {}
    # ratio_mean is exactly 1 until the step's first update (a check that rollout and trainer agree);
    # clip_frac_lower is the share of tokens where the dual clip binds
    logged = ["loss", "clip_frac", "ratio_mean", "approx_kl", "entropy"] + (["kl"] if rl.kl_beta > 0 else []) \
        + (["clip_frac_lower"] if rl.dual_clip is not None else [])
    logs: dict[str, list] = {k: [] for k in logged}
    plan = rank_mini_batches(batches, rl.mini_batch_size, world, spare)  # this rank's share of each
    for _ in range(rl.epochs):
        for parts in plan:
            # out of memory under activation_checkpointing=auto: the mini-batch again, one notch further
            step = redo_on_oom(lambda: mini_batch_backward(t, parts, optimizer, scaler, cfg, logged, packing, replay),
                               t, optimizer, print if world.main else lambda *_: None)
            for k, v in health.step(optimizer, scaler, cfg.optim.max_grad_norm, step["loss"]).items():
                logs.setdefault(k, []).append(v)
            for k, v in step.items():
                logs[k].append(v)
    row = {k: sum(v) / len(v) for k, v in logs.items() if v and k not in ("skipped", "nonfinite_groups")}
    row["skipped"] = sum(logs.get("skipped", []))  # mini-batch updates skipped this step
    if recompute:  # how far the rollout engine's log-probs are from the trainer's (approx_kl's estimator)
        total, tokens = world.sums(*gap)
        row["rollout_approx_kl"] = total / max(tokens, 1.0)
        row.update(mismatch)
    if bad := sorted({g for groups in logs.get("nonfinite_groups", []) for g in groups}):
        row["nonfinite_groups"] = bad
    return row


def mini_batch_backward(t: Trainable, parts: list, optimizer, scaler, cfg: GRPOConfig, logged: list[str],
                        packing: bool, replay: bool) -> dict:
    """This rank's parts of one mini-batch, forward and backward: the parts' gradients add up to the
    mini-batch's (a pad part, (spare, None), runs the collectives of a forward and backward with a
    zero loss). Returns the mini-batch's metrics, summed over every rank's parts."""
    rl, world = cfg.rl, t.world
    real = [(b, part) for b, part in parts if part is not None]
    masks = [b.loss_mask(part) for b, part in real]  # rollout correction's rejected tokens out
    weights, tokens = part_weights(masks, rl.aggregation, world), [float(m.sum()) for m in masks]
    all_tokens = world.sum(sum(tokens))  # the mini-batch's response tokens on every rank
    # MoE: the router loss is the mini-batch's mean over its sequences, whatever rl.agg does
    all_seqs = world.sum(sum(len(part) for _, part in real)) if t.routing is not None else 1.0
    step = dict.fromkeys(logged, 0.0)
    for j, (b, part) in enumerate(parts):
        seqs = b.seqs if part is None else [b.seqs[i] for i in part]
        # MoE with recorded routes: the flips counted and (replay) the rollout's experts taken, in the
        # forward and in checkpointing's recomputation during backward
        routes = route_rows(b.rollout, seqs, packing)
        with no_sync(t.root, last=j == len(parts) - 1), follow(t.routing, routes, replay):
            if part is None:  # padding: the collectives of a forward and backward, no gradient
                with t.policy.autocast():
                    logp = t.forward(sequence_logprobs, b.rollout, cfg.rollout.temperature, seq_index=b.seqs,
                                     keep_vision=world.wrapped, packing=packing)[0]
                scaler.scale(0.0 * logp.sum()).backward()
                continue
            mask, w, share = masks[j], weights[j], tokens[j] / max(all_tokens, 1.0)  # real parts come first
            loss, stats, kl_mean, entropy, routed = part_loss(t, b, part, seqs, mask, cfg, packing)
            # gradients of the parts add up to the mini-batch's; x world size: FSDP2 and DDP average
            # over ranks; MoE: + loss.router_aux_loss_coef x the router load-balancing loss (0 by default)
            aux = aux_term(t.routing, routed, 1) * (len(part) / all_seqs if all_seqs else 0.0)
            scaler.scale((loss * w + aux) * world.size).backward()
            if j < len(parts) - 1:
                hold_gradients(optimizer)  # master_weights=optimizer: bf16 gradients summed in fp32
        step["loss"] += w * float(loss.detach())
        for k in ("clip_frac", "ratio_mean", "approx_kl", "clip_frac_lower"):
            if k in step:
                step[k] += share * float(stats[k])
        if "kl" in step:
            step["kl"] += share * kl_mean  # token-weighted statistics
        step["entropy"] += share * float((entropy * mask).sum() / mask.sum().clamp(min=1))
    with_images = sum(b.rollout.images_of_seq(b.seqs[i]) > 0 for b, part in real for i in part)
    *totals, with_images = world.sums(*step.values(), with_images)  # every rank's parts: the mini-batch's
    if world.wrapped and not with_images:
        drop_keepalive_grads(t.model)
    return dict(zip(step, totals))


def part_loss(t: Trainable, b: Batch, part: list[int], seqs: list[int], mask: torch.Tensor, cfg: GRPOConfig,
              packing: bool):
    """One part's policy loss (+ beta x KL to the reference) over its response tokens, aggregated on its
    own; with the loss's statistics, the KL's token mean (0 without a KL), the token entropies and the
    MoE routes its forward took (train/moe.capture)."""
    rl = cfg.rl
    with t.policy.autocast(), capture(t.routing, token_rows(b.rollout, seqs, packing)) as routed:  # MoE
        logp, entropy = t.forward(sequence_logprobs, b.rollout, cfg.rollout.temperature, seq_index=seqs,
                                  with_entropy=True, keep_vision=t.world.wrapped, chunk_size=cfg.loss.chunk_size,
                                  packing=packing)
    # norm_length: Dr. GRPO's constant divisor is the length cap, not this batch's longest
    old = b.old_logp[part] if b.old_logp is not None else b.rollout.logprobs[seqs]
    loss, stats = policy_loss(logp, old, b.advantages[seqs], mask, *rl.clip_range, dual_clip=rl.dual_clip,
                              agg=rl.aggregation, norm_length=cfg.rollout.max_new_tokens, kind=rl.policy_loss,
                              is_weight=None if b.is_weight is None else b.is_weight[part])
    kl_mean = 0.0
    if rl.kl_beta > 0:
        kl = kl_penalty(logp, b.ref_logp[part], rl.kl_kind)
        # both terms are fp32 (log-probs are); the sum is scaled once, for fp16 only
        loss = loss + rl.kl_beta * agg_loss(kl, mask, rl.aggregation, cfg.rollout.max_new_tokens)
        kl_mean = float((kl.detach() * mask).sum() / mask.sum().clamp(min=1))
    return loss, stats, kl_mean, entropy, routed


def tool_answers(t: Trainable, cfg: GRPOConfig, tools: dict[str, Tool], run_calls):
    """The evaluation's answers with tools.names (train.evaluate.generate_answers' signature):
    each held-out prompt answered greedily as a conversation with the tools, one sample a prompt,
    within rollout.max_new_tokens (the budget of a whole response, as in training; eval.max_new_tokens
    is for single-turn answers); the answer is the last assistant turn, scored as rollouts are."""
    greedy = dataclasses.replace(cfg.rollout, temperature=0.0)

    def answer(model, encoder, samples, *, batch_size: int, max_new_tokens: int, policy, device) -> list[str]:
        out = []
        for s in range(0, len(samples), batch_size):
            # compiled layers eager (the decode shapes change every call); sharded: gathered as for rollouts
            with policy.autocast(), torch.compiler.set_stance("force_eager"), fully_gathered(t.root):
                multi = answer_with_tools(model, encoder, samples[s:s + batch_size], greedy, tools, device, run_calls,
                                          settings=cfg.tools)
            out += [c.strip() for c in multi.completions]
        return out
    return answer


def loss_setting_warnings(rl) -> list[str]:
    """Settings that run but are likely a PPO config's leftovers under another policy loss (the
    shipped configs set DAPO's clip range and token-mean)."""
    low, high = rl.clip_range
    out = []
    if rl.policy_loss == "gspo" and max(low, high) > 0.01:
        out.append(f"rl.policy_loss=gspo with the ratio clipped to [1 - {low:g}, 1 + {high:g}]: a sequence's "
                   "ratio (the geometric mean of its tokens') stays near 1, so this bound rarely acts; the GSPO "
                   "paper clips at 3e-4 / 4e-4 (rl.clip_low and rl.clip_high null give those)")
    if rl.policy_loss == "gspo" and rl.aggregation != "seq-mean-token-mean":
        out.append(f"rl.policy_loss=gspo with rl.agg={rl.aggregation}: GSPO's objective is a mean over sequences "
                   "(rl.agg auto or seq-mean-token-mean)")
    if rl.policy_loss == "cispo" and low < 1:
        out.append(f"rl.policy_loss=cispo with rl.clip_low={low:g}: the importance weight is truncated below at "
                   f"{1 - low:g}; MiniMax-M1's CISPO truncates above only (rl.clip_low null)")
    return out


def refuse_unsupported_sharded(cfg: GRPOConfig, world_size: int, strategy: str = "fsdp2") -> None:
    """What GRPO does not do on several processes (each rank then holds B / N whole groups and
    takes equal shares of every mini-batch), refused before anything starts."""
    rl, rollout = cfg.rl, cfg.rollout
    problems = [
        (rollout.prompts_per_step % world_size != 0, f"rollout.prompts_per_step={rollout.prompts_per_step} not a "
                                                     f"multiple of the {world_size} processes"),
        (rl.mini_batch_size % world_size != 0, f"rl.mini_batch_size={rl.mini_batch_size} not a multiple of the "
                                               f"{world_size} processes"),
        (rollout.precision == "fp8" and strategy == "fsdp2", "rollout.precision=fp8 (its copies are made from "
                                                             "whole weights; FSDP2 holds shards)"),
    ]
    bad = [why for hit, why in problems if hit]
    if bad:
        raise ConfigError(f"distributed GRPO ({strategy}) does not support {'; '.join(bad)} yet: change them or "
                          "run one process")


def refuse_settings(cfg: GRPOConfig) -> None:
    """What GRPO cannot run, refused (and what runs but looks unintended, warned) before anything loads."""
    if cfg.rollout.temperature <= 0:
        raise ConfigError("rollout.temperature must be > 0 for GRPO: it needs sampled responses and their log-probs")
    if cfg.compile.cuda_graphs:
        raise ConfigError(cuda_graphs_problem(cfg, torch.device("cpu")))  # GRPO's refusal, whatever the device
    if not cfg.data.train:
        raise ConfigError("data.train is not set: give a JSONL of prompts with reference answers")
    if cfg.data.packing is True or cfg.data.max_tokens_per_batch:
        raise ConfigError("data.packing / data.max_tokens_per_batch are SFT batching keys: GRPO batches prompts by "
                          "rollout.prompts_per_step (its update packs responses by rl.packing); remove them")
    for problem in loss_setting_warnings(cfg.rl):
        if torchrun_env() is None or torchrun_env()[0] == 0:  # once, not once per rank
            print(f"warning: {problem}", file=sys.stderr)
    if cfg.loss.impl == "liger":
        raise ConfigError("loss.impl=liger: GRPO's log-probs need banned vision tokens and the entropy, which "
                          "liger's fused op cannot give; GRPO always uses the chunked computation (loss.chunk_size)")
    if cfg.rollout.router_replay is not False and not (
            is_moe(dir_config(cfg.model.path)) if cfg.model.path else cfg.model.preset in MOE_PRESETS):
        raise ConfigError(f"rollout.router_replay={cfg.rollout.router_replay}: the model "
                          f"({cfg.model.path or cfg.model.preset}) is dense: it has no experts to route; remove the "
                          "key")


def reference_model(cfg: GRPOConfig, t: Trainable, world: World):
    """The KL's reference with full fine-tuning: a frozen copy of the starting policy (None with LoRA,
    whose base model is the reference, or without KL)."""
    if not (cfg.rl.kl_beta > 0 and cfg.tiers.method == "full"):
        return None
    if world.sharded:  # sharded as the policy is (each rank copies its own shards)
        empty, _ = build_meta_model(cfg.model, dtype=t.policy.compute_dtype, device=world.device)
        ref_model = frozen_sharded_copy(t.model, empty, world, cfg.distributed, t.policy)
        if t.routing is not None:  # MoE: its routers follow the rollout's experts as the policy's do
            t.routing.attach(empty)
        return ref_model
    ref_model = copy.deepcopy(t.model).requires_grad_(False).eval()  # DDP: each rank's
    t.policy.apply(ref_model)  # frozen: stored in the compute dtype, not as fp32 master weights
    return ref_model


def settle_recompute(cfg: GRPOConfig, t: Trainable, data: ChatDataset, world: World) -> None:
    """activation_checkpointing (auto: from the memory of a mini-batch of the longest prompts, each with
    a rollout.max_new_tokens answer; a streamed set's lengths are unread: data.max_length)."""
    longest = cfg.data.max_length if cfg.data.stream else max(data.lengths)
    decide_recompute(cfg, t, cfg.rl.mini_batch_size * (longest + cfg.rollout.max_new_tokens),
                     print if world.main else lambda *_: None)


def checked_before_loading(cfg: GRPOConfig) -> tuple:
    """Everything that can fail from the config and the files alone, before any model loads (a typo in a
    reward spec fails in a second, not after minutes): the run's rewards and tools."""
    refuse_settings(cfg)
    try:  # a judge's model loads at its first use, on the run's device
        rewards = build_rewards([RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in cfg.rl.rewards],
                                factories={"judge": functools.partial(ModelJudge.from_kwargs,
                                                                       load=InferenceModel.load)})
    except (ValueError, FileNotFoundError, AttributeError, TypeError, ImportError) as e:
        raise ConfigError(f"rl.rewards: {e}") from e
    tools = rollout_tools(cfg)  # a tool or chat template that cannot work fails now, not at the first call
    for path in filter(None, (cfg.data.train, cfg.data.val)):
        check_readable(path, cfg.data.on_error, cfg=cfg.data)
    world_size = (torchrun_env() or (0, 1, 0))[1]
    strategy, _ = planned_strategy(cfg.distributed.strategy, world_size, cfg.train.device)
    if strategy != "none":
        refuse_unsupported_sharded(cfg, world_size, strategy)
    return rewards, tools


def run_grpo(cfg: GRPOConfig) -> dict:
    """Train; returns {"output_dir", "final_step", "eval", "first_eval"}."""
    rewards, tools = checked_before_loading(cfg)
    # SIGINT/SIGTERM (train/stop.py): once training runs, the step in progress finishes, then a checkpoint
    with StopSignals() as stop, begin_run(cfg) as (world, resume_from), tool_runner(tools, cfg.tools) as run_calls:
        if cfg.rollout.precision == "fp8" and (problem := fp8_gemm_problem(world.device)):
            raise ConfigError(problem)  # before the model loads
        for fn in rewards.fns:  # a judge model loads on this rank's device, beside the policy (rl/judge.py)
            if isinstance(fn, ModelJudge) and fn.device == "auto":
                fn.device = str(world.device)
        # compile only when asked: rollout decode shapes change every step and would keep recompiling
        t = setup_model(cfg, compile_blocks=cfg.compile.enabled is True, world=world, resume_from=resume_from)
        disable_dropout(t.model)
        # the policy's generation engine, owned by the run: its KV buffers, CUDA graphs and compiled step
        # serve every rollout (rollout.keep_kv=false frees the buffers before each update)
        engine = Engine(t.model)
        ref_model = reference_model(cfg, t, world)
        data = load_dataset(cfg.data.train, t.processor, cfg.data)
        val = load_dataset(cfg.data.val, t.processor, cfg.data) if cfg.data.val else None
        if len(data) < cfg.rollout.prompts_per_step:
            raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} exceeds the "
                              f"{len(data)} prompts")
        total_steps = cfg.train.max_steps or cfg.train.epochs * (len(data) // cfg.rollout.prompts_per_step)
        settle_recompute(cfg, t, data, world)  # before config.yaml, which records it
        # the lr schedule advances once per GRPO step, however many mini-batch updates it makes
        # shared_rng: every rank draws each rollout's seed from the global RNG, which stays in lockstep
        # (dropout off), so a resume on any number of ranks gives every rank rank 0's stream
        run = Run.start(cfg, t, total_steps, val, resume_from, spikes=False, shared_rng=True,
                        answer=tool_answers(t, cfg, tools, run_calls) if tools else None)
        B, G = cfg.rollout.prompts_per_step, cfg.rollout.group_size
        if world.main:
            print(f"GRPO: {len(data)} prompts, {B} x {G} rollouts per step, {total_steps} steps, device {t.device}"
                  + (f", {world.size} processes ({world.strategy})" if world.strategy != "none" else "")
                  + (f"; compiled: {' and '.join(t.compiled)}" if t.compiled else ""))
        first_eval = run.evaluate() if cfg.eval.at_start and run.step == 0 else None
        stream = prompt_stream(data, B, cfg.train.seed, run.state["epoch"], run.state["position"], world)
        bar = tqdm(total=total_steps, initial=run.step, disable=not (cfg.log.progress and world.main), desc="grpo",
                   dynamic_ncols=True)
        stop.watch(run)
        while run.step < total_steps:
            start = time.perf_counter()
            t.model.eval()  # rollouts sample from the policy without dropout
            fp8_row = refresh_rollout_weights(engine, cfg.rollout)  # rollout.precision=fp8: copies of the new weights
            batches, stats, spare = collect(t, data, stream, run.state, cfg, rewards, tools, run_calls, engine=engine)
            if not cfg.rollout.keep_kv:
                engine.release()  # the update gets the KV slots' memory (rollout.keep_kv)
            t_rollout = time.perf_counter() - start
            t.model.train()
            lr = run.lr
            trained = world.sum(len(batches)) > 0  # any rank kept a group: every rank joins the update
            train_logs = update(t, ref_model, batches, run.optimizer, run.scaler, run.health, cfg, spare) \
                if trained else {}
            t_train = time.perf_counter() - start - t_rollout
            row = {**step_metrics(stats, batches, train_logs, t_rollout, t_train, world, G), "lr": lr, **fp8_row,
                   **(t.routing.step_metrics(world) if t.routing else {}),  # MoE: the update's expert load
                   **judge_metrics(rewards, world), "step_time_s": t_rollout + t_train, **peak_memory(t.device)}
            run.samples.grpo(run.step + 1, stats.get("shown"), batches, G)  # samples/grpo.jsonl, when due
            run.finish_step(row, always_log=bool(row.get("skipped")))  # bad steps always logged
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}",
                            mem=f"{row.get('mem/peak_allocated_gb', row.get('mem/peak_rss_gb', 0)):.1f}GB")
            if stop.agreed():  # every rank: one all-reduce of the votes (after step_metrics' syncs)
                break
        stop.checkpoint()
        bar.close()
        run.close()
        if world.main:
            rows = read_metrics(run.out / "metrics.jsonl")
            plot_metric(rows, "reward_mean", run.out / "reward.png", title="GRPO reward per step")
        return {"output_dir": str(run.out), "final_step": run.step, "eval": run.last_eval, "first_eval": first_eval}
