"""The data section (data/ reads it): which files, how rows become samples (lengths, image and
video limits, bad rows), and how samples become batches (packing, token budgets, streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .load import _require

# the keys data.columns may map a set's columns onto (data/layouts.py reads them)
COLUMN_KEYS = ("image", "images", "video", "videos", "text", "prompt", "answer", "system", "messages",
               "conversations", "task", "fps")


@dataclass
class DataConfig:
    train: str | None = None  # the training set: a file or folder data.format reads (docs/data.md)
    val: str | None = None  # the held-out set for periodic eval (eval.*), read alike
    max_length: int = 2048  # tokens per sample, image tokens included
    too_long: Literal["drop", "truncate", "fail"] = "drop"  # truncate only ever cuts answer tokens
    on_error: Literal["fail", "skip"] = "fail"  # bad rows: stop with file:line, or skip and count
    min_pixels: int = 32 * 32  # image resolution limits, passed to the Qwen3-VL image processor
    max_pixels: int = 1024 * 1024  # larger images are downscaled to this many pixels (1024 tokens at 32x32 a token)
    # Decompression-bomb guard: an image file with more pixels is refused from its header, before
    # decoding. PIL itself refuses more than 2 x Image.MAX_IMAGE_PIXELS = 178,956,970: the ceiling.
    max_image_pixels: int = 178_956_970
    # Videos (a list of frames, or a file): a file is sampled at video_fps frames per second (at least
    # 4 frames, as Qwen3-VL's video processor does), and any video cut to video_max_frames frames spread
    # evenly over it. Every 2 frames make one temporal patch; the frames are resized so that all of a
    # video's frames together hold video_min_pixels..video_max_pixels pixels (transformers' video
    # processor's size): the defaults are its class defaults, at most 768 x 32 x 32 pixels = 384 tokens a
    # video (released Qwen3-VL checkpoints ship 25,165,824 pixels and 768 frames). Recorded in the
    # processor the run's checkpoints save (data/encode.record_limits): inference reads videos alike.
    video_fps: float = 2.0  # frames sampled per second of a video file
    video_max_frames: int = 64  # a video's frames at most, spread evenly over it
    video_min_pixels: int = 128 * 32 * 32  # all of a video's frames together: at least this many pixels
    video_max_pixels: int = 768 * 32 * 32  # ... and at most this many
    num_workers: int | Literal["auto"] = "auto"  # DataLoader workers; auto: train.runtime.resolve_num_workers
    # Padding-free packing: a micro-batch's samples concatenated into one row, attention kept inside
    # each sample (block-diagonal, from per-sample position ids) and M-RoPE computed per sample.
    # See docs/packing.md. auto = on where a packed row runs torch's varlen flash kernel (CUDA sm80+,
    # bf16/fp16, model.attention.implementation=sdpa: train/packed_attention.packing_pays), measured at
    # least as fast as padding there (docs/benchmarks.md); off elsewhere (CPU, fp32, eager,
    # flex_attention, flash_attention_2: doctor --config says which)
    packing: bool | Literal["auto"] = "auto"
    # Micro-batches by a token budget instead of train.batch_size samples: packed, the row's total
    # tokens; padded, rows x the longest row. Must fit one sample of data.max_length.
    max_tokens_per_batch: int | None = None
    # Which reader (docs/data.md): auto = by the path (.jsonl, .json, .parquet, a folder of parquet
    # shards or a `datasets` save_to_disk folder); a row's layout (native, ShareGPT/LLaVA, OpenAI
    # messages) is told by its keys
    format: Literal["auto", "jsonl", "json", "parquet", "arrow"] = "auto"
    # {our key: the set's column}, for sets that name them otherwise, e.g. {prompt: problem}
    columns: dict = field(default_factory=dict)
    # Read data.train lazily (rows read when a batch needs them; lengths measured then, not up front:
    # too-long rows are dropped as they come, no token-budget batches); data.val is read whole
    stream: bool = False
    # streaming parquet: the row groups shuffled together (each epoch permutes the groups, then the
    # rows of every `stream_window` consecutive groups): a reader holds that many groups at a time
    stream_window: int = 8

    def __post_init__(self):
        _require(self.max_length >= 8, f"data.max_length must be >= 8, got {self.max_length}")
        bad = [k for k, v in self.columns.items() if k not in COLUMN_KEYS or not isinstance(v, str)]
        _require(not bad, f"data.columns: {bad[0] if bad else ''!r} is not one of {', '.join(COLUMN_KEYS)} "
                          "(each maps one of these keys to the set's column name, a string)")
        _require(not (self.stream and self.max_tokens_per_batch),
                 "data.stream=true reads lengths as rows come, and data.max_tokens_per_batch needs every length "
                 "up front: use train.batch_size with data.stream, or data.stream=false")
        _require(self.stream_window >= 1, f"data.stream_window must be >= 1, got {self.stream_window}")
        _require(self.max_tokens_per_batch is None or self.max_tokens_per_batch >= self.max_length,
                 f"data.max_tokens_per_batch={self.max_tokens_per_batch} is below data.max_length={self.max_length}: "
                 "a sample of the longest allowed length would fit no batch; raise it or lower data.max_length")
        _require(0 < self.min_pixels <= self.max_pixels, "data.min_pixels must be > 0 and <= data.max_pixels")
        _require(0 < self.max_image_pixels <= 178_956_970,
                 f"data.max_image_pixels must be in 1..178956970 (PIL refuses larger images), got {self.max_image_pixels}")
        _require(self.num_workers == "auto" or self.num_workers >= 0, "data.num_workers must be >= 0 or auto")
        _require(self.video_fps > 0, f"data.video_fps must be > 0, got {self.video_fps}")
        _require(self.video_max_frames >= 2, f"data.video_max_frames must be >= 2 (one temporal patch), "
                                             f"got {self.video_max_frames}")
        _require(0 < self.video_min_pixels <= self.video_max_pixels,
                 "data.video_min_pixels must be > 0 and <= data.video_max_pixels")
