"""What a training step costs: step time, tokens/s, peak memory and MFU for each logged row.

MFU (model FLOPs utilisation, PaLM appendix B) = the model FLOPs of a step's batches / (step time x
the device's peak dense bf16 FLOP/s). Model FLOPs (`step_flops`, also bench/train.py's for every
path it compares): per weight of a matmul, 2 per row it multiplies for the forward, 2 more for the
gradient flowing back through it, 2 more where the weight itself trains:
    decoder weights x real tokens (an MoE's experts at top_k of num_experts)
  + lm_head x supervised tokens (the loss reads hidden states at label positions only)
  + vision weights x image patches (a merger's per merged token; forward only when nothing in the
    tower trains)
  + attention scores and values: 3 x 4 x layers x hidden x sum over samples of T^2 / 2 (causal).
So full fine-tuning counts ~6N per token and a frozen base under LoRA ~4N (the adapters' own FLOPs
are left out). Recomputation under activation checkpointing is not useful work and is not counted.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch
from torch import nn

# Dense bf16 tensor-core peak per GPU, from NVIDIA's data sheets (the "without sparsity" figures);
# a name not listed gets no MFU (said once in the log) rather than a guess.
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "H800": 989e12,
    "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L4": 121e12, "B200": 2250e12, "GH200": 989e12,
}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None (a CPU, or a GPU not in the table)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name: str) -> float | None:
    """The table's entry for a CUDA device name ("NVIDIA H100 80GB HBM3"), longest key first ("H100
    PCIe" before "H100", "GH200" before "H200")."""
    return next((PEAK_BF16_FLOPS[k] for k in sorted(PEAK_BF16_FLOPS, key=len, reverse=True) if k in name), None)


def _expert_share(model: nn.Module) -> float:
    cfg = getattr(model.config, "text_config", model.config)
    experts, top_k = getattr(cfg, "num_experts", 0), getattr(cfg, "num_experts_per_tok", 0)
    return top_k / experts if experts and top_k else 1.0


@dataclass(frozen=True)
class FlopWeights:
    """Per-row FLOPs of each part of a model as it is set up to train (the module docstring)."""
    decoder: float  # per real token
    head: float  # per supervised token
    vision: float  # per image patch
    attention: float  # per unit of sum(T^2) / 2

    @classmethod
    def of(cls, model: nn.Module) -> FlopWeights:
        share = _expert_share(model)
        merge = getattr(getattr(model.config, "vision_config", None), "spatial_merge_size", 1)
        vision_trains = any(p.requires_grad for n, p in model.named_parameters() if "visual" in n)
        parts = {"decoder": 0.0, "head": 0.0, "vision": 0.0}
        for module_name, module in model.named_modules():
            if isinstance(module, nn.Embedding):
                continue  # a lookup (the token and position embeddings), no matmul
            for name, p in module.named_parameters(prefix=module_name, recurse=False):
                if p.ndim < 2 or ".lora_" in name:
                    continue  # norms and biases; adapters (left out)
                if "visual" in name:  # per patch; a merger runs once per merge x merge patches
                    per_patch = p.numel() / (merge * merge if "merger" in name else 1)
                    parts["vision"] += per_patch * (6 if p.requires_grad else 4 if vision_trains else 2)
                    continue
                weight = p.numel() * (share if ".experts." in name else 1.0)  # a token runs top_k experts
                # a module's own parameter: a tied lm_head (2B, 4B) is counted here, as the Linear it is
                parts["head" if "lm_head" in name.split(".") else "decoder"] += weight * (6 if p.requires_grad else 4)
        text = getattr(model.config, "text_config", model.config)
        return cls(attention=3 * 4 * text.num_hidden_layers * text.hidden_size, **parts)


def step_flops(weights: FlopWeights, batches: list[dict]) -> float:
    """Model FLOPs of a step's (host) micro-batches: padding and a packed row's filler not counted,
    a packed row's attention per sample (seq_lens)."""
    total = 0.0
    for b in batches:
        lengths = (b["seq_lens"] if "seq_lens" in b else b["attention_mask"].sum(1)).double()
        patches = int(b["image_grid_thw"].prod(-1).sum()) if "image_grid_thw" in b else 0
        supervised = int((b["labels"][:, 1:] != -100).sum())
        total += (weights.decoder * float(lengths.sum()) + weights.head * supervised + weights.vision * patches
                  + weights.attention * float((lengths ** 2).sum()) / 2)
    return total


def peak_memory(device: torch.device) -> dict:
    """Peak memory since the last call (then reset): CUDA's allocated and reserved bytes in GB, or on a
    CPU the process's peak resident set (which never resets: the run's peak so far)."""
    if device.type == "cuda" and torch.cuda.is_available():
        row = {"mem/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
               "mem/peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
        torch.cuda.reset_peak_memory_stats(device)
        return row
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"mem/peak_rss_gb": kib * (1 if sys.platform == "darwin" else 1024) / 1e9}


class StepMeter:
    """The cost fields of each step's metrics row: step_time_s, tokens_per_s, mfu (where the peak
    is known) and the step's peak memory."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device  # batches are this rank's, and so is its device: per-rank MFU
        self.weights = FlopWeights.of(model)
        self.peak = peak_flops(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def why_no_mfu(self) -> str | None:
        if self.peak is not None:
            return None
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "a CPU"
        return f"no MFU in the metrics: the peak FLOP/s of {where} is not in train/throughput.PEAK_BF16_FLOPS"

    def row(self, batches: list[dict], tokens: int, seconds: float) -> dict:
        seconds = max(seconds, 1e-9)
        out = {"step_time_s": seconds, "tokens_per_s": tokens / seconds, **peak_memory(self.device)}
        if self.peak is not None:
            out["mfu"] = step_flops(self.weights, batches) / seconds / self.peak
        return out
