"""Shared builders for recipe tests: a tiny SFT config on the session's shapes data."""

import torch

from vlforge.config import SFTConfig, load_config


def tiny_sft_config(shapes_dir, out_dir, *overrides) -> SFTConfig:
    return load_config(SFTConfig, None, [
        "model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}", f"data.val={shapes_dir / 'val.jsonl'}",
        "precision.mode=fp32", "train.device=cpu", f"train.output_dir={out_dir}", "train.batch_size=4",
        "train.max_steps=2", "log.progress=false", "eval.max_samples=4", "eval.max_new_tokens=3",
        "optim.warmup_steps=0", "tiers.vision.train=true", *overrides])


def compiled_on_cpu(engine, monkeypatch, buckets=None):
    """The engine's compiled path on the CPU: torch.compile with the aot_eager backend (dynamo's and
    AOT autograd's tracing and guards, no inductor; AOT's contiguity checks are what specialized the
    length bucket once), steps run one by one instead of replaying CUDA graphs."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    monkeypatch.setattr(engine, "graphs_on", lambda device: True)

    def run_steps(plan, S, Lb, mode, steps, stats):
        if buckets is not None:
            buckets.add(S)
        for _ in range(steps):
            engine.runner.step(plan, S, Lb, mode)

    monkeypatch.setattr(engine.runner, "run_steps", run_steps)
    return engine


@torch.no_grad()
def transformers_answers(vlm, requests) -> list[tuple[str, str]]:
    """transformers' own `generate` on an InferenceModel's requests, greedy, one request at a time
    (no padding): (text, finish reason) each. The reference the engine's answers are compared with;
    stop strings are not applied (the requests compared have none that occur)."""
    from vlforge.data.encode import collate

    out = []
    for r in requests:
        batch = collate([vlm._item(r)], vlm.encoder.pad_id, left_pad=True)
        inputs = {k: v.to(vlm.device) for k, v in batch.items()}
        with torch.autocast(vlm.device.type, dtype=torch.bfloat16, enabled=vlm.device.type == "cuda"):
            ids = vlm.model.generate(**inputs, max_new_tokens=r.max_new_tokens, do_sample=False,
                                     min_new_tokens=r.min_new_tokens or None, pad_token_id=vlm.encoder.pad_id,
                                     eos_token_id=vlm.end_ids, suppress_tokens=vlm.banned_ids())
        new = ids[0, inputs["input_ids"].shape[1]:].tolist()
        ended = bool(new) and new[-1] in vlm.end_ids
        out.append((vlm.tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True),
                    "stop" if ended else "length"))
    return out
