"""A validated, length-checked dataset and a resumable batch order."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlforge.config import DataConfig
from vlforge.data.encode import Encoder, ImageLimits, Plan, encode, plan_sample
from vlforge.data.jsonl import DataError, LoadReport, Sample, read_jsonl


@dataclass
class SFTDataset(torch.utils.data.Dataset):
    encoder: Encoder
    samples: list[Sample]
    plans: list[Plan]
    report: LoadReport = field(default_factory=LoadReport)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return encode(self.encoder, self.samples[i], self.plans[i])

    @property
    def truncated(self) -> int:
        return sum(p.keep < len(p.ids) for p in self.plans)


def load_dataset(path: str, processor, cfg: DataConfig) -> SFTDataset:
    """Read + validate + plan every row. Bad rows raise (on_error=fail) or are counted (skip)."""
    encoder = Encoder(processor, ImageLimits(cfg.min_pixels, cfg.max_pixels))
    report = LoadReport()
    samples, plans = [], []
    for sample in read_jsonl(path, cfg.on_error, report):
        try:
            plan = plan_sample(encoder, sample, cfg.max_length, cfg.too_long)
        except DataError as e:  # an image that fails when measured
            if cfg.on_error == "fail" or cfg.too_long == "fail":
                raise
            report.skipped["image cannot be measured"] += 1
            report.kept -= 1
            if len(report.first_errors) < 5:
                report.first_errors.append(str(e))
            continue
        if isinstance(plan, str):
            report.skipped[plan] += 1
            report.kept -= 1
            continue
        samples.append(sample)
        plans.append(plan)
    if not samples:
        raise DataError(f"{path}: no usable rows ({report.rows} read, skipped: {dict(report.skipped)})")
    return SFTDataset(encoder, samples, plans, report)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def batches_from(n: int, batch_size: int, seed: int, epoch: int, start: int = 0):
    """Yields (index_list, next_position) for one epoch from sample `start`; drops the ragged tail."""
    order = epoch_order(n, seed, epoch)
    for s in range(start, n - batch_size + 1, batch_size):
        yield order[s:s + batch_size], s + batch_size
