"""Inference: load a model directory or checkpoint (optionally quantized) and generate in batches.

    engine = InferenceEngine.load("merged/", quant=QuantConfig.from_flag("nf4"))
    [out] = engine.generate([Request(messages=[{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}],
                images=[Image.open("x.png")], max_new_tokens=16)])

What it loads: an HF model directory (an `vlforge export` output, a full fine-tuning checkpoint,
or released weights), a LoRA checkpoint (`adapter_config.json`; its base model comes from the
run's `config.yaml`), or a preset name (`tiny`, random weights) for tests and demos.

Requests in one `generate` call are batched (left padding, one `model.generate`), grouped by
their sampling settings; each stops at its own `max_new_tokens` and stop strings. `on_text`
receives each request's new text as it is produced, which the server turns into SSE chunks.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from PIL import Image
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.image_utils import SizeDict

from vlforge.config import ConfigError, ModelConfig, QuantConfig
from vlforge.data.encode import Encoder, ImageLimits, collate
from vlforge.model.presets import PRESETS
from vlforge.serve.shared_images import image_key, share_repeated_images

# Default answer lengths when a request does not say: a class name or a short answer fits in 16 /
# 64 tokens, and a short cap keeps a model that does not stop from running long; descriptions need more.
MAX_NEW_TOKENS = {"classify": 16, "qa": 64, "describe": 512}


@dataclass
class Request:
    messages: list[dict]  # chat messages; image parts are {"type": "image"} placeholders, in order
    images: list[Image.Image] = field(default_factory=list)
    max_new_tokens: int = MAX_NEW_TOKENS["qa"]
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    min_new_tokens: int = 0  # suppress end-of-turn before this many tokens (benchmarks)
    # this request's image resize bounds (the server's per-request min_pixels/max_pixels); None: the engine's
    image_limits: ImageLimits | None = None
    # set from another thread (the server, when the client disconnects): the request's row stops at the
    # next token, the rest of its batch goes on
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.index(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string (held back while
    streaming: it may yet become a stop string, which the final text leaves out)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class _BatchStreamer:
    """The per-row bookkeeping of one batched generate(): transformers calls put() with each step's
    tokens; rows finish at an end token, their own max_new_tokens, a stop string or when cancelled,
    and _RowsDone tells generate() so, which stops computing them. Text goes to on_text(row, new_text)
    as it grows, holding back a tail that may still become a stop string; `text` ends as each row's
    answer.
    """

    def __init__(self, engine: "InferenceEngine", requests: list[Request], on_text: Callable[[int, str], None] | None):
        self.engine, self.requests, self.on_text = engine, requests, on_text
        n = len(requests)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.text, self.sent = [""] * n, [0] * n
        self.done, self.finish = [False] * n, ["length"] * n
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        for row, tok in enumerate(value.reshape(len(self.tokens), -1)[:, -1].tolist()):
            if self.done[row]:
                continue  # generate() pads finished rows
            if self.requests[row].cancelled.is_set():  # nobody waits for this row: its token is dropped
                self.done[row], self.finish[row] = True, "cancelled"
                continue
            if tok in self.engine.end_ids:
                self.done[row], self.finish[row] = True, "stop"
            else:
                self.tokens[row].append(tok)
                self.done[row] = len(self.tokens[row]) >= self.requests[row].max_new_tokens
            self._flush(row)

    def _flush(self, row: int) -> None:
        text = self.engine.tokenizer.decode(self.tokens[row], skip_special_tokens=True)
        text, stopped = _cut_at_stop(text, self.requests[row].stop)
        if stopped:
            self.done[row], self.finish[row] = True, "stop"
        self.text[row] = text
        if not self.done[row]:
            if text.endswith("\ufffd"):
                return  # wait for the rest of a multi-byte character
            text = text[:len(text) - _partial_stop(text, self.requests[row].stop)]
        if len(text) > self.sent[row]:
            if self.on_text is not None:
                self.on_text(row, text[self.sent[row]:])
            self.sent[row] = len(text)

    def end(self) -> None:
        for row in range(len(self.tokens)):
            if not self.done[row]:
                self.done[row] = True
                self._flush(row)


class _RowsDone(StoppingCriteria):
    """Per-row stop for generate(): a row is finished once the streamer says so."""

    def __init__(self, streamer: _BatchStreamer):
        self.streamer = streamer

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.tensor(self.streamer.done, device=input_ids.device)


def processor_pixel_limits(image_processor) -> tuple[int, int]:
    """(min_pixels, max_pixels) an image processor resizes images to: `size` {shortest_edge,
    longest_edge} (transformers 5; Qwen3-VL's preprocessor_config.json), else the min_pixels /
    max_pixels of older Qwen2-VL configs."""
    size = getattr(image_processor, "size", None) or {}
    lo = size.get("shortest_edge") or size.get("min_pixels") or getattr(image_processor, "min_pixels", None)
    hi = size.get("longest_edge") or size.get("max_pixels") or getattr(image_processor, "max_pixels", None)
    if not lo or not hi:
        raise ConfigError(f"the model's image processor ({type(image_processor).__name__}) names no min/max pixels "
                          f"(size={dict(size)}); pass --min-pixels and --max-pixels")
    return int(lo), int(hi)


# How many characters of a text can become one character after Unicode normalization: NFC/NFKC
# compose, and a composed character stands for at most its full decomposition (the longest canonical
# decomposition is 4 code points, compatibility 18: test_serve checks these against unicodedata).
# NFD/NFKD and no normalizer never shorten a text.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 18, "NFD": 1, "NFKD": 1}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text that one token can stand for, or None when the tokenizer
    allows no such bound. A prompt of C characters is then at least C / this many tokens.

    Holds for byte-level BPE (Qwen's): every token is a vocabulary entry of at most B bytes (its
    byte-level string has one character per byte) or an added token matched verbatim, and a
    character is at least one byte, so C characters of normalized text need >= C / B tokens; the
    normalizer may first have shrunk the text by its factor above. Anything that could make one
    token swallow a run of any length (an unknown token, whitespace-stripping added tokens, a
    pre-tokenizer that removes text, another normalizer) gives None: then prompts are only counted.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("unk_token") is not None:
        return None
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in steps) or any(
            p.get("type") not in ("ByteLevel", "Split") or p.get("behavior") == "Removed" for p in steps):
        return None
    shrink = 1
    for n in ([] if norm is None else norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]):
        if n.get("type") not in _NORMALIZER_SHRINK:
            return None
        shrink *= _NORMALIZER_SHRINK[n["type"]]
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    longest = max([len(t) for t in model.get("vocab", {})] + [len(a["content"].encode()) for a in added], default=0)
    return longest * shrink or None


class InferenceEngine:
    def __init__(self, model, processor, device: torch.device, name: str, quant_report: dict | None = None, *,
                 min_pixels: int | None = None, max_pixels: int | None = None):
        self.model, self.processor, self.device, self.name = model, processor, device, name
        self.tokenizer = processor.tokenizer
        self.set_image_limits(min_pixels, max_pixels)
        self.quant_report = quant_report
        # the end-of-generation tokens every vlforge generation path stops at (data/encode.py)
        self.end_ids = self.encoder.end_ids
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        self.lock = threading.Lock()  # one generate at a time on the model
        self.share_images = True  # a batch's repeated images go through the vision tower once
        self.images_shared = 0  # images not encoded again because an identical one was in their batch
        model.eval()

    def set_image_limits(self, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        """Resize bounds of images (pixels per image): the model's own (its processor's, from the
        preprocessor config) unless given; the processor is set to them too, so that its pixels and
        the engine's token counts agree."""
        image_processor = self.processor.image_processor
        own_min, own_max = processor_pixel_limits(image_processor)
        lo = own_min if min_pixels is None else min_pixels
        hi = own_max if max_pixels is None else max_pixels
        for flag, value in (("--min-pixels", min_pixels), ("--max-pixels", max_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} {value!r}: must be a whole number >= 1")
        if lo > hi:
            own = "the model's own, from its preprocessor config"
            raise ConfigError(f"min pixels {lo} ({own if min_pixels is None else '--min-pixels'}) is above max pixels "
                              f"{hi} ({own if max_pixels is None else '--max-pixels'}); pass both so that min <= max")
        image_processor.size = SizeDict(shortest_edge=lo, longest_edge=hi)
        self.encoder = Encoder(self.processor, ImageLimits(min_pixels=lo, max_pixels=hi))

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: str, quant: QuantConfig | None = None, device: str = "auto",
             dtype: torch.dtype = torch.bfloat16, *, min_pixels: int | None = None,
             max_pixels: int | None = None) -> "InferenceEngine":
        """`quant=None`: unquantized, except a LoRA checkpoint of a QLoRA run, which gets its run's quant.
        `min_pixels`/`max_pixels`: image resize bounds; None: the model's processor's own."""
        engine = cls._load(source, quant, device, dtype)
        if min_pixels is not None or max_pixels is not None:
            engine.set_image_limits(min_pixels, max_pixels)
        return engine

    @classmethod
    def _load(cls, source: str, quant: QuantConfig | None, device: str, dtype: torch.dtype) -> "InferenceEngine":
        from vlforge.engine.hardware import quant_problem
        from vlforge.engine.runtime import resolve_device
        from vlforge.model.export import is_sharded, run_config
        from vlforge.model.load import load_model
        from vlforge.model.quant import verify

        dev = resolve_device(device)
        path = Path(source)
        if is_sharded(path):
            raise ConfigError(f"{path} is a sharded (multi-process) checkpoint: consolidate it first with "
                              f"`vlforge export {path} --out DIR`, then load DIR")
        lora = (path / "adapter_config.json").is_file()
        wanted = quant if quant is not None else run_config(path).quant if lora else QuantConfig()
        if problem := quant_problem(wanted, dev):  # before any weight loads
            raise ConfigError(problem)
        if lora:
            return cls._load_lora_checkpoint(path, quant, dev, dtype)
        quant = wanted
        cfg = ModelConfig(path=str(path)) if path.exists() or source not in PRESETS else ModelConfig(preset=source)
        model, processor = load_model(cfg, dtype=dtype, device=dev, quant=quant)
        return cls(model, processor, dev, path.name if cfg.path else source,
                   verify(model, quant) if quant.enabled else None)

    @classmethod
    def _load_lora_checkpoint(cls, ckpt: Path, quant: QuantConfig | None, dev: torch.device, dtype: torch.dtype):
        """The run's base with the adapter on top; quant=None serves a QLoRA adapter on its NF4 base."""
        from vlforge.model.export import load_lora_checkpoint
        from vlforge.model.quant import verify

        model, processor, quant = load_lora_checkpoint(ckpt, dtype, dev, quant)
        return cls(model, processor, dev, ckpt.name, verify(model, quant) if quant.enabled else None)

    # ------------------------------------------------------------------ generation

    def encoder_for(self, request: Request) -> Encoder:
        """The encoder of the request's image limits: the engine's, or a copy at the request's own
        (the same processor; `pixels` and `image_tokens` read `limits`, so pixels and counts agree)."""
        if request.image_limits is None or request.image_limits == self.encoder.limits:
            return self.encoder
        encoder = copy.copy(self.encoder)
        encoder.limits = request.image_limits
        return encoder

    def _inputs(self, requests: list[Request]) -> dict:
        items = []
        for r in requests:
            encoder = self.encoder_for(r)
            ids = encoder.token_ids(r.messages, [im.size for im in r.images], add_generation_prompt=True)
            item = {"input_ids": torch.tensor(ids)}
            item["mm_token_type_ids"] = (item["input_ids"] == encoder.image_token_id).long()
            if r.images:
                item.update(encoder.pixels([im.convert("RGB") for im in r.images]))
                got = int((item["image_grid_thw"].prod(-1) // encoder.merge**2).sum())
                if got != int(item["mm_token_type_ids"].sum()):  # keeps text and pixels provably in step
                    raise RuntimeError(f"the image processor gave {got} image tokens, the prompt has "
                                       f"{int(item['mm_token_type_ids'].sum())} (image limits {encoder.limits})")
            items.append(item)
        return {k: v.to(self.device) for k, v in collate(items, self.encoder.pad_id, left_pad=True).items()}

    def prompt_tokens(self, request: Request) -> int:
        return len(self.encoder_for(request).token_ids(request.messages, [im.size for im in request.images],
                                                       add_generation_prompt=True))

    def min_prompt_tokens(self, messages: list[dict]) -> int:
        """A lower bound of the prompt's tokens from its length in characters, without tokenizing (0
        when the tokenizer allows no bound): rendering the chat template is string work, while the
        tokenizer needs hundreds of bytes per character of a long text."""
        if not self.chars_per_token:
            return 0
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return -(-len(text) // self.chars_per_token)

    @torch.no_grad()
    def generate(self, requests: list[Request], on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Complete every request; batches those with equal sampling settings together."""
        results: list[Completion | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.temperature, r.top_p), []).append(i)
        for (temperature, top_p), index in groups.items():
            callback = None if on_text is None else (lambda row, text, index=index: on_text(index[row], text))
            for i, c in zip(index, self._generate_batch([requests[i] for i in index], temperature, top_p, callback)):
                results[i] = c
        return results  # type: ignore[return-value]

    def _generate_batch(self, requests: list[Request], temperature: float, top_p: float, on_text) -> list[Completion]:
        inputs = self._inputs(requests)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
        if min_new := min(r.min_new_tokens for r in requests):
            sampling["min_new_tokens"] = min_new
        streamer = _BatchStreamer(self, requests, on_text)
        keys = ([image_key(im, self.encoder_for(r).limits) for r in requests for im in r.images]
                if self.share_images else [])
        with self.lock, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"), \
                share_repeated_images(self.model, keys, inputs.get("image_grid_thw")) as shared:
            self.images_shared += shared
            self.model.generate(**inputs, max_new_tokens=max(r.max_new_tokens for r in requests),
                                pad_token_id=self.encoder.pad_id, eos_token_id=self.end_ids, streamer=streamer,
                                stopping_criteria=StoppingCriteriaList([_RowsDone(streamer)]), **sampling)
        return [Completion(text, int(n_prompt), len(tokens), finish) for text, n_prompt, tokens, finish
                in zip(streamer.text, inputs["attention_mask"].sum(1).tolist(), streamer.tokens, streamer.finish)]
