"""Shared builders for recipe tests: a tiny SFT config on the session's shapes data."""

from vlforge.config import SFTConfig, load_config


def tiny_sft_config(shapes_dir, out_dir, *overrides) -> SFTConfig:
    return load_config(SFTConfig, None, [
        "model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}", f"data.val={shapes_dir / 'val.jsonl'}",
        "precision.mode=fp32", "train.device=cpu", f"train.output_dir={out_dir}", "train.batch_size=4",
        "train.max_steps=2", "log.progress=false", "eval.max_samples=4", "eval.max_new_tokens=3",
        "optim.warmup_steps=0", "tiers.vision.train=true", *overrides])
