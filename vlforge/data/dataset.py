"""A validated, length-checked dataset and a resumable batch order.

Lengths are bounded before tokenizing: a row whose text alone holds more than data.max_length tokens
can (its characters over max_length x the most characters one token stands for: data/tokens.py) is
never tokenized whole; only as much of it as truncation keeps (`measure`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from vlforge.config import DataConfig
from vlforge.data.encode import IGNORE_INDEX, Encoder, ImageLimits, SampleTokens, SkippedRow, VideoLimits, encode
from vlforge.data.inline import MAX_IMAGE_PIXELS, DataError
from vlforge.data.jsonl import LoadReport, Sample, open_image
from vlforge.data.sources import LazySamples, open_source, read_samples


# Tokens a text too long for data.max_length is tokenized past max_length before its cut: the cut's
# effect on the tokens near it (a word or a template tag split in two) stays among these, which no
# row keeps (at most max_length tokens are kept, and the prefix holds more than max_length + this).
CUT_MARGIN = 64


def image_sizes(sample: Sample, max_pixels: int = MAX_IMAGE_PIXELS) -> list[tuple[int, int]]:
    """(width, height) of each image, from the headers."""
    sizes = []
    for path in sample.images:
        with open_image(path, sample.source, max_pixels) as im:
            sizes.append(im.size)
    return sizes


@dataclass
class Measured:
    """A sample's tokens as far as data.max_length needs them (`measure`)."""

    ids: list[int]  # the whole conversation's, or (cut) a prefix's, more than max_length of them
    least: int  # its token count (cut: a lower bound, its characters / the most one token stands for)
    cut: bool  # its text was too long to fit max_length tokens: never tokenized whole
    visual: int  # the image and video placeholder tokens of the whole sample
    chars: int  # characters of the conversation as the chat template renders it


def measure(encoder: Encoder, sample: Sample, max_length: int) -> Measured:
    """A sample's tokens; a text of more characters than (max_length + CUT_MARGIN) tokens can hold
    (Encoder.chars_per_token) is tokenized only that far (Encoder.token_prefix): every token stands
    for at most that many characters, so the whole is longer than max_length anyway, and a 50 MB row
    costs what a row of that bound costs. A tokenizer that allows no bound tokenizes every row whole."""
    per_token = encoder.chars_per_token
    max_chars = (max_length + CUT_MARGIN) * per_token if per_token else None
    sizes = image_sizes(sample, encoder.limits.max_image_pixels)
    try:
        ids, chars = encoder.token_prefix(sample.messages, sizes, max_chars, tools=sample.tools, videos=sample.videos)
        video = sum(t * h * w for t, h, w in map(encoder.video_grid, sample.videos))
    except ValueError as e:  # the chat template or the processor cannot encode the row: say which row
        if isinstance(e, DataError):
            raise
        raise DataError(f"{sample.source}: {e}") from None
    visual = sum(encoder.image_tokens(*size) for size in sizes) + (
        video // encoder.video_processor.merge_size**2 if sample.videos else 0)
    cut = max_chars is not None and chars > max_chars
    return Measured(ids, -(-chars // per_token) if cut else len(ids), cut, visual, chars)


def tokenize_sample(encoder: Encoder, sample: Sample, max_length: int, too_long: str) -> SampleTokens | str:
    """Returns a SampleTokens, or the reason the sample is dropped. Raises DataError when too_long == "fail".
    A text too long to fit max_length tokens is handled as any over-long row, never tokenized whole
    (`measure`; truncate keeps max_length tokens of its bounded prefix)."""
    m = measure(encoder, sample, max_length)
    ids = m.ids
    if m.least <= max_length:
        return SampleTokens(ids, encoder.assistant_labels(ids), len(ids))
    if too_long == "fail":
        lower = "data.max_pixels" + (" or data.video_max_pixels / data.video_max_frames" if sample.videos else "")
        count = (f"its text alone ({m.chars:,} characters, at most {encoder.chars_per_token} a token) is at least "
                 f"{m.least:,} tokens, which" if m.cut else f"{len(ids)} tokens (images and videos included)")
        raise DataError(f"{sample.source}: {count} exceed data.max_length={max_length}; raise data.max_length, "
                        f"lower {lower}, or set data.too_long=drop|truncate")
    if too_long == "truncate":
        labels = encoder.assistant_labels(ids)
        visual = (encoder.image_token_id, encoder.video_token_id)
        kept_visual = sum(1 for t in ids[:max_length - 1] if t in visual)
        supervised = sum(1 for t in labels[:max_length] if t != IGNORE_INDEX)
        if kept_visual == m.visual and supervised > 0:
            return SampleTokens(ids, labels, max_length)
        return "too long (cut would fall inside an image or video span or remove the whole answer)"
    return "too long"


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

    @property
    def lengths(self) -> list[int]:
        """Each sample's token count (image tokens included), as trained: for token-budget batches."""
        return [p.keep for p in self.tokenized]


class Unmeasured:
    """A streamed set's lengths: its size, and its row groups for a local shuffle (`epoch_order`);
    no length is known before its row is read, so token budgets are refused (DataConfig)."""

    def __init__(self, n: int, blocks: list[int] | None, window: int):
        self.n, self.blocks, self.window = n, blocks, window

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        raise DataError("data.stream=true measures a row's tokens when it is read: no length is known up front "
                        "(token-budget batches need them: set data.stream=false)")


@dataclass
class StreamDataset(ChatDataset):
    """data.stream: rows read, validated, measured and tokenized when a batch takes them (`samples`
    is a LazySamples). A row dropped as too long, or (on_error=skip) a bad row, becomes a SkippedRow
    that `collate` leaves out and counts: batches of a streamed set can be smaller than batch_size."""

    max_length: int = 2048
    too_long: str = "drop"
    window: int = 8

    def __getitem__(self, i: int) -> dict | SkippedRow:
        try:
            sample = self.samples[i]
            tokens = tokenize_sample(self.encoder, sample, self.max_length, self.too_long)
            if isinstance(tokens, str):  # dropped by data.too_long: counted, as the eager set counts it
                return SkippedRow(f"{sample.source}: {tokens}")
            return encode(self.encoder, sample, tokens)
        except DataError as e:
            if self.on_error == "fail" or self.too_long == "fail":
                raise
            tqdm.write(f"warning: skipping a row (data.on_error=skip): {e}", file=sys.stderr)
            return SkippedRow(str(e))

    @property
    def truncated(self) -> int:
        return 0  # not known before the rows are read

    @property
    def lengths(self) -> Unmeasured:
        return Unmeasured(len(self.samples), self.samples.source.blocks, self.window)


def load_dataset(path: str, processor, cfg: DataConfig) -> ChatDataset:
    """Read + validate + tokenize every row (any format: data/sources.py). Bad rows raise
    (on_error=fail) or are counted (skip). data.stream: data.train is opened, not read (StreamDataset)."""
    encoder = Encoder(processor, ImageLimits(cfg.min_pixels, cfg.max_pixels, cfg.max_image_pixels),
                      VideoLimits.of(cfg))
    report = LoadReport()
    if cfg.stream and path == cfg.train:
        source = open_source(path, cfg.format, cfg.stream_window)
        if len(source) == 0:
            raise DataError(f"{path}: has no rows")
        report.rows = report.kept = len(source)
        return StreamDataset(encoder, LazySamples(source, cfg), [], report, cfg.on_error, cfg.max_length,
                             cfg.too_long, cfg.stream_window)
    samples, tokenized = [], []
    for sample in read_samples(path, cfg, cfg.on_error, report):
        try:
            tokens = tokenize_sample(encoder, sample, cfg.max_length, cfg.too_long)
        except DataError as e:  # an image that fails when measured
            if cfg.on_error == "fail" or cfg.too_long == "fail":
                raise
            report.skip(e, "image cannot be measured")
            report.kept -= 1
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


def block_order(blocks: list[int], window: int, seed: int, epoch: int) -> list[int]:
    """A streamed parquet set's epoch order: its row groups permuted, then the rows of each
    `window` consecutive groups permuted together, so a reader holds `window` groups at a time.
    A function of (seed, epoch) only, as epoch_order: a resume continues it exactly."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    groups = torch.randperm(len(blocks) - 1, generator=g).tolist()
    order = []
    for w in range(0, len(groups), window):
        rows = torch.cat([torch.arange(blocks[k], blocks[k + 1]) for k in groups[w:w + window]])
        order += rows[torch.randperm(len(rows), generator=g)].tolist()
    return order


def epoch_order(n, seed: int, epoch: int) -> list[int]:
    """The sample order of one epoch: a permutation that depends only on (seed, epoch). `n`: a
    count, or a dataset's lengths (a streamed parquet set's: `block_order`)."""
    if getattr(n, "blocks", None):
        return block_order(n.blocks, n.window, seed, epoch)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n if isinstance(n, int) else len(n), generator=g).tolist()


def batches_from(n, batch_size: int, seed: int, epoch: int, start: int = 0):
    """Yields (index_list, next_position) for one epoch from sample `start`; drops the ragged tail.
    `n`: a count, or a dataset's lengths (epoch_order)."""
    order = epoch_order(n, seed, epoch)
    for s in range(start, len(order) - batch_size + 1, batch_size):
        yield order[s:s + batch_size], s + batch_size


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def budget_batches(lengths: list[int], max_tokens: int, packed: bool, seed: int, epoch: int, start: int = 0,
                   multiple: int = 1):
    """Yields (index_list, next_position) for one epoch from sample `start`, each batch as many
    samples, in epoch order, as fit `max_tokens`: packed, their total length; padded, rows x the
    longest row. Every sample of the epoch is in exactly one batch (the last may be small).

    `multiple`: the row length `collate` / `pack` round up to (FP8 GEMMs: 16, train.fp8.token_multiple);
    the budget holds for the rounded rows, the tokens the step actually computes.

    Greedy in the (seed, epoch) order, so a batch depends only on where it starts: resuming from
    a position continues exactly as the uninterrupted run. (A lookahead bin packer would fill
    rows better but would tie each batch to the ones before it.)"""
    order = epoch_order(len(lengths), seed, epoch)
    batch, total, longest = [], 0, 0
    for pos in range(start, len(order)):
        n = lengths[order[pos]]
        if _round_up(n, multiple) > max_tokens:
            rounded = (f" ({_round_up(n, multiple)} as a row padded to a multiple of {multiple}: FP8 GEMMs or "
                       "compile.cuda_graphs)") if multiple > 1 else ""
            raise DataError(f"a sample of {n} tokens{rounded} exceeds data.max_tokens_per_batch={max_tokens}: "
                            f"raise it to at least {_round_up(n, multiple)} (or lower data.max_length)")
        cost = _round_up(total + n, multiple) if packed else _round_up(max(longest, n), multiple) * (len(batch) + 1)
        if batch and cost > max_tokens:
            yield batch, pos
            batch, total, longest = [], 0, 0
        batch.append(order[pos])
        total, longest = total + n, max(longest, n)
    if batch:
        yield batch, len(order)


@dataclass(frozen=True)
class Batching:
    """How micro-batches are formed: `batch_size` samples, or (max_tokens set) by a token budget."""

    batch_size: int
    max_tokens: int | None = None
    packed: bool = False
    multiple: int = 1  # rows are padded to a multiple of this (FP8): the budget counts the padded rows

    @classmethod
    def of(cls, cfg: DataConfig, batch_size: int, multiple: int = 1, packed: bool | None = None) -> "Batching":
        """`packed`: data.packing resolved (train/packed_attention.packing_pays for auto); None: the
        config's own true/false."""
        if packed is None:
            if cfg.packing == "auto":
                raise ValueError("data.packing=auto must be resolved for the model and device (packing_pays) first")
            packed = cfg.packing
        return cls(batch_size, cfg.max_tokens_per_batch, packed, multiple)

    @property
    def packed_length(self) -> int | None:
        """A fixed length for every packed row (flex_attention compiles per shape): the budget,
        rounded down to the row multiple; every budgeted row, rounded up, fits it."""
        return self.max_tokens // self.multiple * self.multiple if self.packed and self.max_tokens else None


def global_batches(lengths: list[int], batching: Batching, seed: int, epoch: int, start: int = 0, world_size: int = 1):
    """Yields (one index list per rank, next_position) for one epoch: a global micro-batch.

    Fixed size: batch_size x world_size samples (the order one process takes), rank r taking the
    r-th slice; the ragged tail is dropped. Token budget: world_size consecutive budget batches,
    rank r taking the r-th; a tail of fewer batches than ranks is dropped (with one process,
    nothing is). Either way every rank gets one micro-batch per global micro-batch: equal numbers
    of forwards, which sharded (FSDP2) training needs (every rank joins every unit's collectives),
    and the sequence of budget batches does not depend on the number of ranks."""
    if batching.max_tokens is None:
        size = batching.batch_size
        for ix, pos in batches_from(lengths, size * world_size, seed, epoch, start):
            yield [ix[r * size:(r + 1) * size] for r in range(world_size)], pos
        return
    group = []
    for ix, pos in budget_batches(lengths, batching.max_tokens, batching.packed, seed, epoch, start,
                                   batching.multiple):
        group.append(ix)
        if len(group) == world_size:
            yield group, pos
            group = []


def micro_batches_per_epoch(lengths: list[int], batching: Batching, seed: int, epoch: int, world_size: int = 1) -> int:
    """Global micro-batches in one epoch (with a token budget the count depends on the epoch's order)."""
    if batching.max_tokens is None:
        return len(lengths) // (batching.batch_size * world_size)
    return sum(1 for _ in global_batches(lengths, batching, seed, epoch, 0, world_size))
