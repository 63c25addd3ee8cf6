"""What the model did, in the run directory: bounded sample logs for `vlforge view` and the trackers.

    output_dir/samples/grpo.jsonl   one row per logged GRPO group: prompt, images, G responses with
                                    each reward function's value, advantage, length, truncation,
                                    correctness and tool turns (their text and images)
    output_dir/samples/eval.jsonl   one row per evaluated probe: image, question, answer, reference, match
    output_dir/samples/img/H.png    every image once, as a thumbnail named by the hash of its pixels

Bounded: log.samples_per_step groups every log.samples_every steps, texts cut at TEXT_CHARS, images
as thumbnails of THUMB_SIDE pixels at most, eval rows at log.samples_eval per evaluation, and the
whole folder at log.samples_max_mb (past it, sampling stops with one warning: training goes on).
Resume-safe as metrics.jsonl is: rows after the resumed step are dropped (they will be redone) and
a line torn by a crash is dropped, so a resumed run holds each step once.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

from PIL import Image

from vlforge.data.jsonl import open_image
from vlforge.train.metrics import _rows
from vlforge.train.runtime import SAMPLES_DIR

TEXT_CHARS = 4000  # a response's text past this is cut (a note says how much): rows stay small
THUMB_SIDE = 256  # the longer side of a thumbnail, in pixels: enough to see what the model saw
FOLDER = SAMPLES_DIR


def cut(text: str, limit: int = TEXT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f" [... {len(text) - limit} more characters]"


def text_of(content) -> str:
    """A chat message's text: a string, or the text parts of a list of parts (images are stored apart)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict) and p.get("type") == "text")


class SampleLog:
    """The sample files of one run (rank 0 writes; other ranks get `write=False` and write nothing)."""

    def __init__(self, output_dir: str | Path, *, every: int = 1, per_step: int = 2, eval_rows: int = 32,
                 max_mb: float = 100.0, resume_step: int | None = None, write: bool = True, trackers=None):
        self.dir = Path(output_dir) / FOLDER
        self.every, self.per_step, self.eval_rows = every, per_step, eval_rows
        self.max_bytes, self.write, self.trackers = int(max_mb * 2**20), write, trackers
        self.full = False
        if not write:
            return
        (self.dir / "img").mkdir(parents=True, exist_ok=True)
        for name in ("grpo.jsonl", "eval.jsonl"):
            path = self.dir / name
            if path.exists():  # as MetricsLog: steps after the checkpoint go, and a torn last line
                kept = [line for line, row in _rows(path) if resume_step is None or row.get("step", 0) <= resume_step]
                tmp = path.with_name(name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, path)
        self.used = sum(f.stat().st_size for f in self.dir.rglob("*") if f.is_file())

    def due(self, step: int) -> bool:
        return bool(self.write and self.every and self.per_step and step % self.every == 0 and not self.full)

    def image(self, image: Image.Image) -> str:
        """The thumbnail's file name (img/HASH.png), written once per distinct image."""
        im = image.convert("RGB")
        digest = hashlib.sha256(f"{im.size}".encode() + im.tobytes()).hexdigest()[:24]
        path = self.dir / "img" / f"{digest}.png"
        if not path.exists():
            thumb = im.copy()
            thumb.thumbnail((THUMB_SIDE, THUMB_SIDE))
            buf = io.BytesIO()
            thumb.save(buf, format="PNG", optimize=True)
            tmp = path.with_name(path.name + ".tmp")  # renamed: a reader never sees half an image
            tmp.write_bytes(buf.getvalue())
            os.replace(tmp, path)
            self.used += len(buf.getvalue())
        return f"img/{path.name}"

    def _append(self, name: str, rows: list[dict]) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        if self.used + len(lines) > self.max_bytes:
            self.full = True
            print(f"warning: {self.dir} reached log.samples_max_mb={self.max_bytes / 2**20:g}: no more samples are "
                  "logged this run (metrics and checkpoints go on); raise it to keep logging them", file=sys.stderr)
            return
        with open(self.dir / name, "a") as f:
            f.write(lines)
        self.used += len(lines)
        if self.trackers is not None:
            self.trackers.samples(name.removesuffix(".jsonl"), rows, self.dir)

    def grpo(self, step: int, shown: dict | None, batches: list, group_size: int) -> None:
        """Log a GRPO step's first groups at `step`, when due (grpo_groups says what a row holds)."""
        if shown is not None and self.due(step):
            self._append("grpo.jsonl", [{"step": step, **g} for g in grpo_groups(self, shown, batches, group_size)])

    def eval(self, step: int, samples: list, answers: list[str], hits: list[float]) -> None:
        """Log an evaluation's probes (data.jsonl Samples), the model's answers and whether each matched."""
        if not (self.write and self.eval_rows) or self.full:
            return
        rows = []
        for i, (s, a, h) in enumerate(list(zip(samples, answers, hits))[:self.eval_rows]):
            rows.append({"step": step, "probe": i, "source": s.source, "images": self.images(s.images),
                         "question": cut(prompt_text(s.prompt_messages)), "answer": cut(a),
                         "reference": cut(s.answer), "correct": bool(h)})
        self._append("eval.jsonl", rows)

    def images(self, images) -> list[str]:
        """The thumbnails of a sample's images (files or embedded bytes, data/jsonl.Sample.images)."""
        names = []
        for path in images:
            with open_image(path) as im:
                names.append(self.image(im))
        return names


def prompt_text(messages: list[dict]) -> str:
    """The prompt as a reader wants it: its system and user turns' text (images are shown apart)."""
    return "\n\n".join(text_of(m["content"]) for m in messages if m["role"] in ("system", "user")).strip()


def grpo_groups(log: SampleLog, shown: dict, batches: list, group_size: int) -> list[dict]:
    """The first log.samples_per_step groups of a step's first rollout round on this rank, as rows.

    `shown`: that round's rollout_round output (texts, samples, per-function rewards, transcripts);
    `batches`: the step's kept batches (their advantages, after any batch statistics): a group left
    out (zero reward variance under dynamic sampling) has advantage None: it was not trained."""
    rollout, G = shown["rollout"], group_size
    adv: dict[int, float] = {}
    for b in batches:
        if b.rollout is rollout:
            values = b.advantages.cpu().tolist()  # one read of the device tensor, not one per sequence
            adv.update({s: values[s] for s in b.seqs})
    lengths = rollout.loss_mask.sum(1).tolist()
    finished = rollout.finished.tolist()
    groups = []
    for g, sample in enumerate(shown["samples"][:log.per_step]):
        responses = []
        for n in range(g * G, (g + 1) * G):
            r = {"text": cut(shown["texts"][n]), "reward": float(shown["reward"][n]),
                 "rewards": {k: float(v[n]) for k, v in shown["per_fn"].items()},
                 "advantage": adv.get(n), "length": int(lengths[n]), "truncated": not finished[n],
                 "correct": bool(shown["correct"][n])}
            if shown.get("transcripts") is not None:
                r["turns"] = [_turn(log, m) for m in shown["transcripts"][n]]
            responses.append(r)
        groups.append({"group": g, "source": sample.source, "prompt": cut(prompt_text(sample.prompt_messages)),
                       "images": log.images(sample.images), "reference": cut(sample.answer),
                       "responses": responses})
    return groups


def _turn(log: SampleLog, message: dict) -> dict:
    """A multi-turn transcript message with its tool images stored as thumbnails."""
    turn = {"role": message["role"], "content": cut(str(message.get("content", "")))}
    if message["role"] == "tool":
        turn.update(name=message.get("name"), ok=message.get("ok", True),
                    images=[log.image(im) for im in message.get("images", [])])
    return turn


def read_samples(run_dir: str | Path, kind: str) -> list[dict]:
    """The rows of a run's samples/KIND.jsonl (grpo or eval); torn lines dropped with a warning."""
    path = Path(run_dir) / FOLDER / f"{kind}.jsonl"
    return [row for _, row in _rows(path)] if path.exists() else []
