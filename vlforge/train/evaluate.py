"""Held-out evaluation during training: teacher-forced loss and greedy-generation exact-match accuracy.

Used by every training recipe (periodic eval, eval.json) and by the demo's before/after table.
Generation stops at the encoder's end ids, the same ones `vlforge infer`/`serve` stop at, so a
run's eval answers are the answers its exported model gives (tested).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from vlforge.config import EvalConfig, LossConfig
from vlforge.data.dataset import ChatDataset
from vlforge.data.encode import Encoder, collate, encode, encode_engine_prompt, encode_prompt
from vlforge.train.losses import sft_loss_sum
from vlforge.train.metrics import MetricsLog, write_json_atomic
from vlforge.train.precision import PrecisionPolicy
from vlforge.train.samples import SampleLog
from vlforge.generate.engine import Engine
from vlforge.generate.forward import never_generated
from vlforge.generate.requests import GenRequest, Prompt
from vlforge.model.host_inputs import host_to_device
from vlforge.model.tiers import unwrap
from vlforge.rl.rewards import exact_match


def sharded_run(model) -> bool:
    """FSDP2 over several processes: every forward gathers weights with the other ranks. (DDP's
    replicas generate on their own: its forward has no collective, only its backward.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and \
        any(isinstance(p, DTensor) for p in model.parameters())


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: host_to_device(v, device) for k, v in batch.items()}  # pinned, non-blocking: no sync


@torch.no_grad()
def generate_answers(model, encoder: Encoder, samples, *, batch_size: int, max_new_tokens: int,
                     policy: PrecisionPolicy, device: torch.device) -> list[str]:
    """Greedy answers for each sample's prompt (everything before its final assistant turn), on
    a generate/ Engine with `batch_size` decode slots (continuous batching: a finished answer's
    slot takes the next prompt). Sharded (FSDP2), every forward gathers weights with the other
    ranks, so ranks must decode in step: there transformers' generate with synced_gpus does it.
    Videos reach the engine as images (frames_as_images)."""
    if sharded_run(model):
        return _generate_answers_hf(model, encoder, samples, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                    policy=policy, device=device, synced=True)
    prompts = []
    for x in samples:
        item = encode_engine_prompt(encoder, x)  # videos as images: the engine prefills images
        prompts.append(Prompt(item["input_ids"], item.get("pixel_values"), item.get("image_grid_thw")))
    requests = [GenRequest(p, max_new_tokens=max_new_tokens) for p in prompts]
    # compiled decoder layers (compile.enabled) run eager here: decode shapes change every call and
    # would recompile them (the engine compiles its own decode step where that pays: GRPO rollouts)
    with policy.autocast(), torch.compiler.set_stance("force_eager"):
        # an engine of this pass's own: its KV buffers are freed with it (a training run's memory goes back)
        results = Engine(model).generate(requests, stop_ids=encoder.end_ids,
                                         banned_ids=never_generated(encoder, model),
                                         image_token_id=encoder.image_token_id, pad_id=encoder.pad_id,
                                         slots=batch_size)
    tok = encoder.tokenizer
    return [tok.decode(r.tokens, skip_special_tokens=True).strip() for r in results]


@torch.no_grad()
def _generate_answers_hf(model, encoder: Encoder, samples, *, batch_size: int, max_new_tokens: int,
                         policy: PrecisionPolicy, device: torch.device, synced: bool) -> list[str]:
    """transformers' generate, left-padded batches of `batch_size` (`synced`: FSDP2's synced_gpus)."""
    core = unwrap(model)
    answers = []
    for s in range(0, len(samples), batch_size):
        chunk = samples[s:s + batch_size]
        batch = to_device(collate([encode_prompt(encoder, x) for x in chunk], encoder.pad_id, left_pad=True), device)
        with policy.autocast(), torch.compiler.set_stance("force_eager"):
            out = core.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=encoder.pad_id, eos_token_id=encoder.end_ids, synced_gpus=synced,
                                suppress_tokens=never_generated(encoder, model))  # as the engine path bans
        new = out[:, batch["input_ids"].shape[1]:]
        answers += [t.strip() for t in encoder.tokenizer.batch_decode(new, skip_special_tokens=True)]
    return answers


@torch.no_grad()
def evaluate(model, data: ChatDataset, *, batch_size: int, max_new_tokens: int, max_samples: int | None,
             policy: PrecisionPolicy, device: torch.device, loss: LossConfig = LossConfig(),
             answer: Callable | None = None, record: Callable | None = None) -> dict:
    """{"loss", "accuracy", "n", "by_task"} on the first `max_samples` samples of `data`; the
    held-out loss computed as the run computes its training loss (`loss`: the run's loss.impl).
    `answer`: generate_answers' stand-in (same signature), e.g. GRPO's answers with its tools.
    `record(samples, answers, hits)`: given every evaluated probe (train/samples.SampleLog.eval)."""
    was_training = model.training
    model.eval()
    n = len(data) if max_samples is None else min(max_samples, len(data))
    loss_sum, tokens = 0.0, 0
    for s in range(0, n, batch_size):
        items = [encode(data.encoder, data.samples[i], data.tokenized[i]) for i in range(s, min(n, s + batch_size))]
        batch = to_device(collate(items, data.encoder.pad_id), device)
        with policy.autocast():
            batch_loss, count = sft_loss_sum(model, batch, loss=loss)
        loss_sum += float(batch_loss)
        tokens += count
    samples = data.samples[:n]
    answers = (answer or generate_answers)(model, data.encoder, samples, batch_size=batch_size,
                                           max_new_tokens=max_new_tokens, policy=policy, device=device)
    hits = [exact_match(a, s.answer) for a, s in zip(answers, samples)]
    if record is not None:  # every probe with its answer (the run's samples/eval.jsonl)
        record(samples, answers, hits)
    by_task: dict[str, list[float]] = defaultdict(list)
    for h, s in zip(hits, samples):
        by_task[str(s.fields.get("task", "all"))].append(h)
    model.train(was_training)
    return {
        "loss": loss_sum / max(tokens, 1),
        "accuracy": sum(hits) / max(n, 1),
        "n": n,
        "by_task": {k: sum(v) / len(v) for k, v in sorted(by_task.items())},
        "examples": [{"answer": s.answer, "generated": a} for s, a in list(zip(samples, answers))[:5]],
    }


class EvalRecorder:
    """Periodic evaluation of a run: eval.json (latest + history) and eval rows in metrics.jsonl.

    Evaluation saves and restores the torch RNG, so evaluating never changes a training run.
    On resume, history entries after the resumed step are dropped (they will be redone).
    """

    def __init__(self, out_dir: Path, data: ChatDataset, cfg: EvalConfig, metrics: MetricsLog, resume_step: int,
                 write: bool = True, loss: LossConfig = LossConfig(), answer: Callable | None = None,
                 samples: SampleLog | None = None):
        self.path = Path(out_dir) / "eval.json"
        self.data, self.cfg, self.metrics, self.write = data, cfg, metrics, write  # write: rank 0 of a run
        self.loss, self.answer, self.samples = loss, answer, samples  # samples: samples/eval.jsonl
        previous = json.loads(self.path.read_text()).get("history", []) if write and self.path.exists() else []
        self.history = [h for h in previous if h["step"] <= resume_step]

    def __call__(self, model, step: int, policy: PrecisionPolicy, device: torch.device) -> dict:
        rng = torch.get_rng_state()
        result = {"step": step, **evaluate(model, self.data, batch_size=self.cfg.batch_size,
                                           max_new_tokens=self.cfg.max_new_tokens, max_samples=self.cfg.max_samples,
                                           policy=policy, device=device, loss=self.loss, answer=self.answer,
                                           record=self.samples and (lambda *p: self.samples.eval(step, *p)))}
        torch.set_rng_state(rng)
        self.history.append({k: v for k, v in result.items() if k != "examples"})
        if self.write:
            write_json_atomic({**result, "history": self.history}, self.path)
        self.metrics.log(step, {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"]})
        return result
