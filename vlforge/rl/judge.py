"""A vision-language model as a GRPO reward (`rl.rewards: [{name: judge, kwargs: {...}}]`).

For every response of a step the judge model answers one prompt, built from a template with the
question (the text of the sample's last prompt message), the reference answer and the response,
with the sample's images in front, greedily. Its reply becomes the score:

    score: yes_no   1.0 when the reply starts with "yes", 0.0 when with "no"
    score: number   the first number of the reply / `scale`, clipped to [0, 1]

A reply that parses as neither scores 0.0 and is counted (logged by the recipe as
`reward/judge/unparsed_frac`, every rank's replies).

Where the judge runs, one of:
- `model`: a local model, loaded once in the run's process beside the policy on the same device,
  batched on generate/'s engine (through `load`, which the recipe passes: infer/model.InferenceModel.load,
  the loader of `vlforge infer`: a model directory, a checkpoint or the preset `tiny`; never a
  download); its memory is the model's weights and the KV of `batch_size` prompts. The judge sees
  the loaded model only through JudgeModel, so this module stays below the inference package.
- `endpoint`: an OpenAI-compatible chat-completions server (`vlforge serve` on another GPU or
  machine, vLLM, ...) at that base URL (`http://host:8000/v1`), `batch_size` requests at once, the
  images and video files sent inline as data URLs; `model` is then the served model's name (optional).

A judge that cannot answer stops the step with a JudgeError naming the judge (model or endpoint),
the sample and what to do, never a silent 0: an image it cannot read, no reply within `timeout_s`
(a local batch's rows are cancelled at the engine's next step; an endpoint's request times out
on its connection or between bytes), an endpoint's error status, an out-of-memory. `retries`: the
tries after a failure that another try may cure: an endpoint's timeout, lost connection or 5xx / 429
status (after a pause of 0.5 s, doubled each time); a local batch out of memory (split in halves,
each tried again). A local timeout is not retried: the same greedy batch would take as long.
"""

from __future__ import annotations

import base64
import functools
import http.client
import inspect
import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol
from pathlib import Path
from urllib.parse import urlparse

import torch

from vlforge.config import ConfigError, QuantConfig
from vlforge.data.jsonl import open_image
from vlforge.data.request import Request

DEFAULT_PROMPT = ("You grade answers to questions about images.\nQuestion: {question}\nReference answer: {answer}\n"
                  "Candidate answer: {completion}\nDoes the candidate answer mean the same as the reference answer? "
                  "Reply with yes or no.")
SCORES = ("yes_no", "number")
_WORD = re.compile(r"[a-z]+")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
RETRY_PAUSE_S = 0.5  # an endpoint's first retry waits this long, each next one twice as long
_RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # busy or failing for now: another try may pass


class JudgeError(RuntimeError):
    """The judge gave no score for a sample: the message names the judge, the sample and what to do."""


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
    """The videos of the prompt's messages, in order (dataset video parts carry a data.video.Video)."""
    return [p["video"] for m in messages if not isinstance(m["content"], str)
            for p in m["content"] if p.get("type") == "video" and p.get("video") is not None]


class _Deadline(threading.Event):
    """A request's `cancelled` flag that is also set once `at` (time.monotonic) has passed: the vlm
    reads it at every sync point of the generating thread, so a late batch stops there, no timer thread."""

    def __init__(self, at: float):
        super().__init__()
        self.at = at

    def is_set(self) -> bool:
        return super().is_set() or time.monotonic() >= self.at


class JudgeModel(Protocol):
    """What the judge needs of a local model (infer/model.InferenceModel has it): images and videos
    decoded as its processor takes them, and greedy completions of chat requests."""

    encoder: Any  # data/encode.Encoder: decode_image(path, where), decode_video(video, where)

    def generate(self, requests: list[Request]) -> list: ...  # completions with .text and .finish_reason


class ModelJudge:
    """A batched reward (rl/rewards.py): `judge(completions, answers, fields, prompts)` -> scores."""

    batched = True

    def __init__(self, model: str | None = None, prompt: str = DEFAULT_PROMPT, score: str = "yes_no",
                 scale: float = 10.0, max_new_tokens: int = 8, batch_size: int = 32, images: bool = True,
                 device: str = "auto", quant: str | None = None, endpoint: str | None = None,
                 timeout_s: float = 120.0, retries: int = 2, *,
                 load: Callable[..., JudgeModel] | None = None):
        """Settings only: a local model loads at the first use of `vlm` (through `load(model, device=,
        quant=)`, the recipe's loader: not a reward kwarg), so that the recipe can build its rewards
        (and fail on a bad spec) before any model loads and set `device` once the run knows it."""
        self.load = load
        self.model = model if model in (None, "tiny") or endpoint else str(Path(model).expanduser())
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.prompt, self.score, self.scale = prompt, score, scale
        self.max_new_tokens, self.batch_size, self.images = max_new_tokens, batch_size, images
        self.device, self.quant = device, quant
        self.timeout_s, self.retries = timeout_s, retries
        self.scored = self.unparsed = 0  # replies since the recipe last read them

    @property
    def where(self) -> str:
        """The judge as messages name it: its endpoint or its model."""
        return f"endpoint {self.endpoint}" if self.endpoint else f"model {self.model}"

    @classmethod
    def from_kwargs(cls, load: Callable[..., JudgeModel] | None = None, **kwargs) -> "ModelJudge":
        """A judge from a reward spec's kwargs, checked first (validate); `load`: the recipe's model loader."""
        cls.validate(**kwargs)
        return cls(**kwargs, load=load)

    @functools.cached_property
    def vlm(self) -> JudgeModel:
        if self.load is None:  # a recipe that builds judges passes its loader (rewards' factories)
            raise JudgeError(f"judge {self.where}: no model loader was given (ModelJudge.from_kwargs(load=...))")
        return self.load(self.model, device=self.device,
                         quant=QuantConfig.from_flag(self.quant) if self.quant else None)

    @classmethod
    def validate(cls, **kwargs) -> None:
        """The `kwargs` of a judge reward checked without loading or asking anything (the recipe calls it
        before any model loads): known keys, a local model (a directory, or the test preset `tiny`: the
        other presets are random weights, no judge) or an endpoint URL, the template, the score kind,
        the quant method, the limits."""
        keys = [k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "load")]
        try:
            if "load" in kwargs:  # the recipe's loader, never a reward kwarg
                raise TypeError("got an unexpected keyword argument 'load'")
            bound = inspect.signature(cls.__init__).bind(None, **kwargs)
        except TypeError as e:
            raise ConfigError(f"rl.rewards judge kwargs: {e}; valid keys: {', '.join(keys)}") from None
        bound.apply_defaults()
        a = bound.arguments
        model, endpoint, prompt = a["model"], a["endpoint"], a["prompt"]
        if endpoint is not None:
            _check_endpoint(endpoint, a["quant"])
        elif model is None:
            raise ConfigError("rl.rewards judge: give model (a local model directory) or endpoint (an "
                              "OpenAI-compatible server's URL, e.g. http://127.0.0.1:8000/v1 from `vlforge serve`)")
        elif model != "tiny" and not Path(str(model)).expanduser().is_dir():
            raise ConfigError(f"rl.rewards judge: model {model!r} is not a directory: give a local model directory "
                              "(released weights, `vlforge export` output, a checkpoint), or 'tiny' for tests")
        if a["quant"] is not None:
            QuantConfig.from_flag(a["quant"])  # nf4 | int8 | fp8 | none, else a ConfigError
        if a["score"] not in SCORES:
            raise ConfigError(f"rl.rewards judge: score {a['score']!r}: one of {', '.join(SCORES)}")
        try:
            prompt.format(question="", answer="", completion="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"rl.rewards judge: prompt: a placeholder other than {{question}}, {{answer}}, "
                              f"{{completion}} ({e}); write literal braces as {{{{ }}}}") from None
        if a["max_new_tokens"] < 1 or a["batch_size"] < 1 or not a["scale"] > 0:
            raise ConfigError("rl.rewards judge: max_new_tokens and batch_size must be >= 1, scale > 0")
        if not a["timeout_s"] > 0 or not isinstance(a["retries"], int) or a["retries"] < 0:
            raise ConfigError(f"rl.rewards judge: timeout_s must be > 0 (got {a['timeout_s']}) and retries an "
                              f"integer >= 0 (got {a['retries']!r})")

    def texts(self, completions: list[str], answers: list[str], prompts: list[list[dict]]) -> list[str]:
        """Each response's filled-in template."""
        return [self.prompt.format(question=question_of(m), answer=a, completion=c)
                for c, a, m in zip(completions, answers, prompts)]

    def requests(self, completions: list[str], answers: list[str], prompts: list[list[dict]]) -> list[Request]:
        """One greedy request a response: its sample's images and videos, then the filled-in template."""
        out, decoded = [], {}  # a prompt's G responses share its decoded images and videos
        for i, (text, messages) in enumerate(zip(self.texts(completions, answers, prompts), prompts)):
            paths = image_paths(messages) if self.images else []
            videos = videos_of(messages) if self.images else []
            try:
                for p in paths:
                    if p not in decoded:
                        decoded[p] = self.vlm.encoder.decode_image(Path(p), f"judge {self.where}, sample {i}")
                for v in videos:  # decoded once for the prompt's G responses, as its images are
                    if v not in decoded:
                        decoded[v] = self.vlm.encoder.decode_video(v, f"judge {self.where}, sample {i}")
            except (ValueError, OSError) as e:  # DataError (a ValueError) names the file and the sample
                raise JudgeError(f"{e}; fix or drop the row (the judge is shown the sample's images and videos; "
                                 "images: false shows it none)") from e
            content = ([{"type": "image"} for _ in paths] + [{"type": "video"} for _ in videos]
                       + [{"type": "text", "text": text}])
            out.append(Request([{"role": "user", "content": content}], [decoded[p] for p in paths], videos=videos,
                               video_frames=[decoded[v] for v in videos] if videos else None,
                               max_new_tokens=self.max_new_tokens))
        return out

    def __call__(self, completions: list[str], answers: list[str], fields: list[dict],
                 prompts: list[list[dict]]) -> list[float]:
        if self.endpoint:
            replies = self._ask_endpoint(completions, answers, prompts)
        else:
            requests = self.requests(completions, answers, prompts)
            batches = [list(range(s, min(s + self.batch_size, len(requests))))
                       for s in range(0, len(requests), self.batch_size)]
            replies = [text for index in batches
                       for text in self._generate(requests[index[0]:index[-1] + 1], index, self.retries)]
        scores = [parse_score(r, self.score, self.scale) for r in replies]
        self.scored += len(scores)
        self.unparsed += sum(s is None for s in scores)
        return [0.0 if s is None else s for s in scores]

    def _generate(self, requests: list[Request], index: list[int], retries: int) -> list[str]:
        """The local model's replies to `requests` (samples `index`), within timeout_s; a batch out of
        memory is split in halves while `retries` last."""
        deadline = _Deadline(time.monotonic() + self.timeout_s)
        for r in requests:
            r.cancelled = deadline
        try:
            done = self.vlm.generate(requests)
        except torch.OutOfMemoryError as e:
            if retries <= 0 or len(requests) == 1:
                raise JudgeError(f"judge {self.where}: out of memory answering samples {_span(index)} "
                                 f"({e}); lower the judge's batch_size or max_new_tokens, or quantize it "
                                 "(quant: nf4)") from e
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the failed batch's blocks, before the halves allocate theirs
            half = len(requests) // 2
            return (self._generate(requests[:half], index[:half], retries - 1)
                    + self._generate(requests[half:], index[half:], retries - 1))
        except Exception as e:  # a generation error: the judge and the samples named, not a bare traceback
            raise JudgeError(f"judge {self.where}: generation failed on samples {_span(index)}: "
                             f"{type(e).__name__}: {e}") from e
        late = [index[k] for k, c in enumerate(done) if c.finish_reason == "cancelled"]
        if late:
            raise JudgeError(f"judge {self.where}: no reply within timeout_s={self.timeout_s:g} s for samples "
                             f"{late[:8]}{' ...' if len(late) > 8 else ''} (a batch of {len(requests)}, up to "
                             f"max_new_tokens={self.max_new_tokens} each); raise timeout_s, or lower batch_size")
        return [c.text for c in done]

    def _ask_endpoint(self, completions: list[str], answers: list[str], prompts: list[list[dict]]) -> list[str]:
        """The endpoint's replies, `batch_size` requests in flight at once (its server batches them)."""
        urls: dict = {}  # a prompt's G responses send its images and videos, read and encoded once
        bodies = [self._body(i, text, messages, urls)
                  for i, (text, messages) in enumerate(zip(self.texts(completions, answers, prompts), prompts))]
        with ThreadPoolExecutor(max_workers=min(self.batch_size, len(bodies)) or 1,
                                thread_name_prefix="vlforge-judge") as pool:
            return list(pool.map(self._ask, range(len(bodies)), bodies, [q[:60] for q in map(question_of, prompts)]))

    def _body(self, i: int, text: str, messages: list[dict], urls: dict) -> bytes:
        """Sample i's chat-completions request: its images and video files inline (`urls`: those made
        already, by path or video), then the template."""
        parts = []
        try:
            for p in image_paths(messages) if self.images else []:
                if p not in urls:
                    with open_image(p, f"judge {self.where}, sample {i}") as im:  # the header: a missing or bad file
                        kind = (im.format or "png").lower()
                    urls[p] = _data_url(Path(p).read_bytes(), "image", kind)
                parts.append({"type": "image_url", "image_url": {"url": urls[p]}})
            for v in videos_of(messages) if self.images else []:
                if not v.is_file:
                    raise ValueError(f"judge {self.where}, sample {i}: its video {v} is a frame list; an endpoint "
                                     "takes video files (data:video/... URLs): give the row a video file, or use "
                                     "a local judge (model)")
                if v not in urls:
                    urls[v] = _data_url(v.source if isinstance(v.source, bytes) else Path(v.source).read_bytes(),
                                        "video", "mp4")
                parts.append({"type": "video_url", "video_url": {"url": urls[v]}})
        except (ValueError, OSError) as e:
            raise JudgeError(f"{e}; fix or drop the row (images: false shows the judge none)") from e
        body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                "max_tokens": self.max_new_tokens, "temperature": 0}
        if self.model:
            body["model"] = self.model
        return json.dumps(body).encode()

    def _ask(self, i: int, body: bytes, question: str) -> str:
        """One sample's reply from the endpoint, tried again (retries) where another try may pass."""
        url = f"{self.endpoint}/chat/completions"
        sample = f"sample {i} (question {question!r})"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:  # urllib, not httpx: one JSON POST needs no dependency beyond the standard library
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _reply_text(response.read(), self.where, sample)
            except urllib.error.HTTPError as e:
                problem = f"HTTP {e.code}: {_error_message(e)}"
                if e.code not in _RETRIED_STATUS:
                    raise JudgeError(f"judge {self.where} refused {sample}: {problem}; fix the judge's settings "
                                     "or that server's limits") from None
            except (TimeoutError, urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                # no answer in time, no connection, or one lost mid-answer
                reason = getattr(e, "reason", e)
                problem = (f"no answer within timeout_s={self.timeout_s:g} s"
                           if isinstance(reason, TimeoutError) else f"{type(reason).__name__}: {reason}")
        raise JudgeError(f"judge {self.where} gave no reply for {sample} in {self.retries + 1} tries (last: "
                         f"{problem}); check that the server runs and keeps up, or raise the judge's timeout_s "
                         "/ retries")

    def take_counts(self) -> tuple[int, int]:
        """(replies that gave no score, replies) since the last call."""
        counts = (self.unparsed, self.scored)
        self.scored = self.unparsed = 0
        return counts


def _check_endpoint(endpoint, quant) -> None:
    url = urlparse(str(endpoint))
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ConfigError(f"rl.rewards judge: endpoint {endpoint!r} is not an http(s) URL: give the server's "
                          "base URL, e.g. http://127.0.0.1:8000/v1 (`vlforge serve`)")
    if quant is not None:
        raise ConfigError("rl.rewards judge: quant is for a local model; an endpoint's server loads its own "
                          "(vlforge serve --quant): remove quant or endpoint")


def _span(index: list[int]) -> str:
    return f"{index[0]}..{index[-1]}" if len(index) > 1 else str(index[0])


def _data_url(raw: bytes, kind: str, subtype: str) -> str:
    return f"data:{kind}/{subtype};base64,{base64.b64encode(raw).decode()}"


def _reply_text(raw: bytes, where: str, sample: str) -> str:
    """The assistant's text of a chat-completions response; a response of another shape is a JudgeError."""
    try:
        text = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise JudgeError(f"judge {where} answered {sample} with no chat completion ({type(e).__name__}: "
                         f"{raw[:200]!r}); the endpoint must be an OpenAI-compatible /chat/completions") from None
    return text if isinstance(text, str) else ""


def _error_message(e: urllib.error.HTTPError) -> str:
    """An error response's message (OpenAI's {"error": {"message": ...}}), else the start of its body."""
    try:
        raw = e.read()
    except OSError:
        return str(e.reason)
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or str(e.reason)
