"""A local vision-language model as a GRPO reward (`rl.rewards: [{name: judge, kwargs: {...}}]`).

For every response of a step the judge model answers one prompt, built from a template with the
question (the text of the sample's last prompt message), the reference answer and the response,
with the sample's images in front, greedily, batched on generate/'s engine (InferenceEngine, the
same loader as `vlforge infer`: a model directory, a checkpoint or the preset `tiny`; never a
download). Its reply becomes the score:

    score: yes_no   1.0 when the reply starts with "yes", 0.0 when with "no"
    score: number   the first number of the reply / `scale`, clipped to [0, 1]

A reply that parses as neither scores 0.0 and is counted (logged by the recipe as
`reward/judge/unparsed_frac`, every rank's replies). The judge is loaded once, beside the policy on
the same device, and runs without gradients; its memory is the model's weights and the KV of
`batch_size` prompts.
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path

from vlforge.config import ConfigError, QuantConfig
from vlforge.serve.engine import InferenceEngine, Request

DEFAULT_PROMPT = ("You grade answers to questions about images.\nQuestion: {question}\nReference answer: {answer}\n"
                  "Candidate answer: {completion}\nDoes the candidate answer mean the same as the reference answer? "
                  "Reply with yes or no.")
SCORES = ("yes_no", "number")
_WORD = re.compile(r"[a-z]+")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(reply: str, score: str, scale: float = 10.0) -> float | None:
    """The score a judge's reply gives, or None when it gives none (see the module docstring)."""
    if score == "yes_no":
        word = _WORD.search(reply.lower())
        return None if word is None or word.group() not in ("yes", "no") else float(word.group() == "yes")
    number = _NUMBER.search(reply)
    return None if number is None else min(1.0, max(0.0, float(number.group()) / scale))


def question_of(messages: list[dict]) -> str:
    """The text of the last user message (its text parts joined): what the policy was asked."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message["content"]
            return content if isinstance(content, str) else " ".join(p["text"] for p in content
                                                                     if p.get("type") == "text")
    return ""


def image_paths(messages: list[dict]) -> list[str]:
    """The image paths of the prompt's messages, in order (dataset image parts carry `image`)."""
    return [p["image"] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p.get("type") == "image" and p.get("image")]


def videos_of(messages: list[dict]) -> list:
    """The videos of the prompt's messages, in order (dataset video parts carry a data.jsonl.Video)."""
    return [p["video"] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p.get("type") == "video" and p.get("video") is not None]


class ModelJudge:
    """A batched reward (rl/rewards.py): `judge(completions, answers, fields, prompts)` -> scores."""

    batched = True

    def __init__(self, model: str, prompt: str = DEFAULT_PROMPT, score: str = "yes_no", scale: float = 10.0,
                 max_new_tokens: int = 8, batch_size: int = 32, images: bool = True, device: str = "auto",
                 quant: str | None = None):
        """Settings only: the model loads at the first use of `engine`, so that the recipe can build its
        rewards (and fail on a bad spec) before any model loads and set `device` once the run knows it."""
        self.model = model if model == "tiny" else str(Path(model).expanduser())
        self.prompt, self.score, self.scale = prompt, score, scale
        self.max_new_tokens, self.batch_size, self.images = max_new_tokens, batch_size, images
        self.device, self.quant = device, quant
        self.scored = self.unparsed = 0  # replies since the recipe last read them

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ModelJudge":
        """A judge from a reward spec's kwargs, checked first (validate)."""
        cls.validate(**kwargs)
        return cls(**kwargs)

    @functools.cached_property
    def engine(self) -> InferenceEngine:
        return InferenceEngine.load(self.model, device=self.device,
                                    quant=QuantConfig.from_flag(self.quant) if self.quant else None)

    @classmethod
    def validate(cls, **kwargs) -> None:
        """The `kwargs` of a judge reward checked without loading anything (the recipe calls it before
        any model loads): known keys, the model a directory (or the test preset `tiny`: the other
        presets are random weights, no judge), the template, the score kind, the quant method."""
        try:
            bound = inspect.signature(cls.__init__).bind(None, **kwargs)
        except TypeError as e:
            keys = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
            raise ConfigError(f"rl.rewards judge kwargs: {e}; valid keys: {', '.join(keys)}") from None
        bound.apply_defaults()
        a = bound.arguments
        model, prompt, score, scale = a["model"], a["prompt"], a["score"], a["scale"]
        max_new_tokens, batch_size = a["max_new_tokens"], a["batch_size"]
        if model != "tiny" and not Path(str(model)).expanduser().is_dir():
            raise ConfigError(f"rl.rewards judge: model {model!r} is not a directory: give a local model directory "
                              "(released weights, `vlforge export` output, a checkpoint), or 'tiny' for tests")
        if a["quant"] is not None:
            QuantConfig.from_flag(a["quant"])  # nf4 | int8 | fp8 | none, else a ConfigError
        if score not in SCORES:
            raise ConfigError(f"rl.rewards judge: score {score!r}: one of {', '.join(SCORES)}")
        try:
            prompt.format(question="", answer="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"rl.rewards judge: prompt: a placeholder other than {{question}}, {{answer}}, "
                              f"{{completion}} ({e}); write literal braces as {{{{ }}}}") from None
        if max_new_tokens < 1 or batch_size < 1 or not scale > 0:
            raise ConfigError("rl.rewards judge: max_new_tokens and batch_size must be >= 1, scale > 0")

    def requests(self, completions: list[str], answers: list[str], prompts: list[list[dict]]) -> list[Request]:
        """One greedy request a response: its sample's images and videos, then the filled-in template."""
        out, decoded = [], {}  # a prompt's G responses share its decoded images and videos
        for completion, answer, messages in zip(completions, answers, prompts):
            paths = image_paths(messages) if self.images else []
            for p in paths:
                if p not in decoded:
                    decoded[p] = self.engine.encoder.decode_image(Path(p), "judge")
            images = [decoded[p] for p in paths]
            videos = videos_of(messages) if self.images else []
            for v in videos:  # decoded once for the prompt's G responses, as its images are
                if v not in decoded:
                    decoded[v] = self.engine.encoder.decode_video(v, "judge")
            text = self.prompt.format(question=question_of(messages), answer=answer, completion=completion)
            content = ([{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos]
                       + [{"type": "text", "text": text}])
            out.append(Request([{"role": "user", "content": content}], images, videos=videos,
                               video_frames=[decoded[v] for v in videos] if videos else None,
                               max_new_tokens=self.max_new_tokens))
        return out

    def __call__(self, completions: list[str], answers: list[str], fields: list[dict],
                 prompts: list[list[dict]]) -> list[float]:
        requests = self.requests(completions, answers, prompts)
        replies = [c.text for i in range(0, len(requests), self.batch_size)
                   for c in self.engine.generate(requests[i:i + self.batch_size])]
        scores = [parse_score(r, self.score, self.scale) for r in replies]
        self.scored += len(scores)
        self.unparsed += sum(s is None for s in scores)
        return [0.0 if s is None else s for s in scores]

    def take_counts(self) -> tuple[int, int]:
        """(replies that gave no score, replies) since the last call."""
        counts = (self.unparsed, self.scored)
        self.scored = self.unparsed = 0
        return counts
