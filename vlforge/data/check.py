"""`vlforge data check`: everything worth knowing about a dataset (any format) before a long run."""

from __future__ import annotations

from collections import Counter

from vlforge.config import DataConfig
from vlforge.data.dataset import measure
from vlforge.data.encode import IGNORE_INDEX, Encoder, ImageLimits, VideoLimits
from vlforge.data.inline import DataError
from vlforge.data.jsonl import LoadReport
from vlforge.data.sources import iter_samples


def _percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def check_file(path: str, processor, cfg: DataConfig) -> dict:
    """Validate every row (never stops at the first error), decode every image and video in full (a
    truncated file must fail here, not mid-run) and measure token lengths."""
    report = LoadReport()
    samples = iter_samples(path, cfg, on_error="skip", report=report, decode_images=True)
    encoder = Encoder(processor, ImageLimits(cfg.min_pixels, cfg.max_pixels, cfg.max_image_pixels),
                      VideoLimits.of(cfg))
    lengths, answer_tokens, image_tokens, video_tokens = [], [], [], []
    over, cut, images, videos = 0, 0, 0, 0
    tasks = Counter()
    valid = 0
    for s in samples:
        try:
            m = measure(encoder, s, cfg.max_length)  # a text too long to fit is not tokenized whole: its lower bound
        except DataError as e:  # the chat template or the processor cannot encode it: one more error row
            report.skip(e, "cannot be encoded")
            continue
        valid += 1
        lengths.append(m.least)
        cut += m.cut
        if not m.cut:  # the means are over the rows tokenized whole
            answer_tokens.append(sum(t != IGNORE_INDEX for t in encoder.assistant_labels(m.ids)))
            image_tokens.append(sum(t == encoder.image_token_id for t in m.ids))
            video_tokens.append(sum(t == encoder.video_token_id for t in m.ids))
        images += len(s.images)
        videos += len(s.videos)
        over += m.least > cfg.max_length
        if "task" in s.fields:
            tasks[str(s.fields["task"])] += 1
    lengths.sort()
    errors = sum(report.skipped.values())
    return {
        "file": str(path),
        "rows": report.rows,
        "valid_rows": valid,
        "errors": errors,
        "errors_by_reason": dict(report.skipped),
        "first_errors": report.first_errors,
        "images": images,
        "videos": videos,
        "tokens": {"p50": _percentile(lengths, 50), "p90": _percentile(lengths, 90), "p99": _percentile(lengths, 99),
                   "max": lengths[-1] if lengths else 0, "mean": sum(lengths) / max(1, len(lengths))},
        "image_tokens_mean": sum(image_tokens) / max(1, len(image_tokens)),
        "video_tokens_mean": sum(video_tokens) / max(1, len(video_tokens)),
        "answer_tokens_mean": sum(answer_tokens) / max(1, len(answer_tokens)),
        "max_length": cfg.max_length,
        "over_max_length": over,
        "over_max_length_untokenized": cut,  # of those, rows whose text alone cannot fit: counted at a lower bound
        "over_max_length_action": cfg.too_long,
        "tasks": dict(tasks),
    }


def format_check(r: dict) -> str:
    t = r["tokens"]
    videos = f", {r['videos']} videos" if r["videos"] else ""
    video_tokens = f"; video tokens (mean) {r['video_tokens_mean']:.1f}" if r["videos"] else ""
    lines = [
        f"{r['file']}: {r['rows']} rows, {r['valid_rows']} valid, {r['errors']} with errors, {r['images']} images"
        f"{videos} (each decoded in full)",
        f"tokens per sample (images{' and videos' if videos else ''} included): p50 {t['p50']}  p90 {t['p90']}  "
        f"p99 {t['p99']}  max {t['max']}  mean {t['mean']:.1f}",
        f"image tokens per sample (mean) {r['image_tokens_mean']:.1f}{video_tokens}; answer tokens (mean) "
        f"{r['answer_tokens_mean']:.1f}",
        f"over data.max_length={r['max_length']}: {r['over_max_length']} rows (data.too_long={r['over_max_length_action']})",
    ]
    if r["over_max_length_untokenized"]:
        lines.append(f"  {r['over_max_length_untokenized']} of them hold more text than data.max_length tokens can: "
                     "not tokenized whole, their lengths are lower bounds (characters / the most one token holds)")
    if r["tasks"]:
        lines.append("tasks: " + ", ".join(f"{k} {v}" for k, v in sorted(r["tasks"].items())))
    if r["errors"]:
        lines.append("errors by reason: " + "; ".join(f"{k}: {v}" for k, v in r["errors_by_reason"].items()))
        lines += ["  " + e for e in r["first_errors"]]
    return "\n".join(lines)


__all__ = ["check_file", "format_check", "DataError"]
