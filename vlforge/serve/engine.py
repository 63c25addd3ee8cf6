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

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from PIL import Image
from transformers import StoppingCriteria, StoppingCriteriaList

from vlforge.config import ModelConfig, QuantConfig
from vlforge.data.encode import Encoder, ImageLimits, collate
from vlforge.model.presets import PRESETS

# Short answers for classification / QA, longer for descriptions (seed 004's advice): used when
# a request does not say.
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


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length"


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.index(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string (held back while
    streaming: it may yet become a stop string, which the final text leaves out)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class _BatchStreamer:
    """The per-row bookkeeping of one batched generate(): transformers calls put() with each step's
    tokens; rows finish at an end token, their own max_new_tokens or a stop string, and _RowsDone
    tells generate() so, which stops computing them. Text goes to on_text(row, new_text) as it
    grows, holding back a tail that may still become a stop string; `text` ends as each row's answer.
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


class InferenceEngine:
    def __init__(self, model, processor, device: torch.device, name: str, quant_report: dict | None = None):
        self.model, self.processor, self.device, self.name = model, processor, device, name
        self.tokenizer = processor.tokenizer
        self.encoder = Encoder(processor, ImageLimits(min_pixels=32 * 32, max_pixels=1024 * 1024))
        self.quant_report = quant_report
        # <|im_end|> ends a turn; <|endoftext|> (the pad token) ends generation too, as in Qwen's own
        # generation_config, so the streamed and the final text stop at the same token
        self.end_ids = list(dict.fromkeys([self.encoder.im_end_id, self.encoder.pad_id]))
        self.lock = threading.Lock()  # one generate at a time on the model
        model.eval()

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: str, quant: QuantConfig | None = None, device: str = "auto",
             dtype: torch.dtype = torch.bfloat16) -> "InferenceEngine":
        """`quant=None`: unquantized, except a LoRA checkpoint of a QLoRA run, which gets its run's quant."""
        from vlforge.engine.runtime import resolve_device
        from vlforge.model.load import load_model
        from vlforge.model.quant import verify

        dev = resolve_device(device)
        path = Path(source)
        if (path / "adapter_config.json").is_file():
            return cls._load_lora_checkpoint(path, quant, dev, dtype)
        quant = quant or QuantConfig()
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

    def _inputs(self, requests: list[Request]) -> dict:
        items = []
        for r in requests:
            ids = self.encoder.token_ids(r.messages, [im.size for im in r.images], add_generation_prompt=True)
            item = {"input_ids": torch.tensor(ids)}
            item["mm_token_type_ids"] = (item["input_ids"] == self.encoder.image_token_id).long()
            if r.images:
                item.update(self.encoder.pixels([im.convert("RGB") for im in r.images]))
            items.append(item)
        return {k: v.to(self.device) for k, v in collate(items, self.encoder.pad_id, left_pad=True).items()}

    def prompt_tokens(self, request: Request) -> int:
        return len(self.encoder.token_ids(request.messages, [im.size for im in request.images], add_generation_prompt=True))

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
        with self.lock, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            self.model.generate(**inputs, max_new_tokens=max(r.max_new_tokens for r in requests),
                                pad_token_id=self.encoder.pad_id, eos_token_id=self.end_ids, streamer=streamer,
                                stopping_criteria=StoppingCriteriaList([_RowsDone(streamer)]), **sampling)
        return [Completion(text, int(n_prompt), len(tokens), finish) for text, n_prompt, tokens, finish
                in zip(streamer.text, inputs["attention_mask"].sum(1).tolist(), streamer.tokens, streamer.finish)]
