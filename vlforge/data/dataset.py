"""A validated, length-checked dataset and a resumable batch order."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from vlforge.config import DataConfig
from vlforge.data.encode import Encoder, ImageLimits, SampleTokens, SkippedRow, encode, tokenize_sample
from vlforge.data.jsonl import DataError, LoadReport, Sample, read_jsonl


@dataclass
class ChatDataset(torch.utils.data.Dataset):
    """Validated chat samples (SFT conversations, GRPO prompts with reference answers), tokenized."""

    encoder: Encoder
    samples: list[Sample]
    tokenized: list[SampleTokens]  # token ids + labels per sample, planned from image headers
    report: LoadReport = field(default_factory=LoadReport)
    on_error: str = "fail"  # data.on_error, for images that fail only when decoded (__getitem__)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict | SkippedRow:
        """Model inputs of sample i. With on_error=skip, a sample whose image fails to decode becomes
        a SkippedRow, which `collate` leaves out of the batch and counts (batch["skipped_rows"]): the
        count travels in the batch because DataLoader workers hold their own copy of this dataset."""
        try:
            return encode(self.encoder, self.samples[i], self.tokenized[i])
        except DataError as e:
            if self.on_error == "fail":
                raise
            tqdm.write(f"warning: skipping a row (data.on_error=skip): {e}", file=sys.stderr)
            return SkippedRow(str(e))

    @property
    def truncated(self) -> int:
        return sum(p.keep < len(p.ids) for p in self.tokenized)


def load_dataset(path: str, processor, cfg: DataConfig) -> ChatDataset:
    """Read + validate + tokenize every row. Bad rows raise (on_error=fail) or are counted (skip)."""
    encoder = Encoder(processor, ImageLimits(cfg.min_pixels, cfg.max_pixels, cfg.max_image_pixels))
    report = LoadReport()
    samples, tokenized = [], []
    for sample in read_jsonl(path, cfg.on_error, report, max_image_pixels=cfg.max_image_pixels):
        try:
            tokens = tokenize_sample(encoder, sample, cfg.max_length, cfg.too_long)
        except DataError as e:  # an image that fails when measured
            if cfg.on_error == "fail" or cfg.too_long == "fail":
                raise
            report.skipped["image cannot be measured"] += 1
            report.kept -= 1
            if len(report.first_errors) < 5:
                report.first_errors.append(str(e))
            continue
        if isinstance(tokens, str):  # the reason it is dropped
            report.skipped[tokens] += 1
            report.kept -= 1
            continue
        samples.append(sample)
        tokenized.append(tokens)
    if not samples:
        raise DataError(f"{path}: no usable rows ({report.rows} read, skipped: {dict(report.skipped)})")
    return ChatDataset(encoder, samples, tokenized, report, cfg.on_error)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation that depends only on (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def batches_from(n: int, batch_size: int, seed: int, epoch: int, start: int = 0):
    """Yields (index_list, next_position) for one epoch from sample `start`; drops the ragged tail."""
    order = epoch_order(n, seed, epoch)
    for s in range(start, n - batch_size + 1, batch_size):
        yield order[s:s + batch_size], s + batch_size
